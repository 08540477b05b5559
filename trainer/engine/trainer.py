"""The training job: DeepSpeed backbone + head, the sharded classifier, the paper's two techniques,
checkpoints, metrics and a clean stop on SIGTERM.

One step on each rank::

    views -> engine (backbone + head, ZeRO) -> features [V*b, D]
          -> classifier (DHP: all-gather, chunked CE, 2 all-reduces) -> loss
    engine.backward(loss); engine.step()             # backbone grads averaged over all ranks
    classifier.reduce_weight_grad(); sgd.step()      # shard grads stay local (or replica-averaged)

Host syncs happen only on log steps (loss value, input validation, NaN check, comm timers) and
for the one tiny CPU all-reduce per step that agrees on SIGTERM.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from data_pipeline.loader import build_loader
from data_pipeline.manifest import ShardManifest
from trainer.classifier import ClassifierConfig, ShardedCosineClassifier
from trainer.classifier.hard_negatives import HardNegativeTable, search_hard_negatives
from trainer.config import JobConfig
from trainer.engine.checkpoint import TrainerState, load_checkpoint, reseed, resolve_resume, save_checkpoint
from trainer.engine.deepspeed_setup import engine_dtype, initialize_backbone, load_deepspeed_config, plain_model_from_engine
from trainer.engine.preemption import NonFiniteWatch, StopSignal
from trainer.engine.prior import contrastive_prior
from trainer.engine.schedule import LRSchedule, scaled_lr, set_lr
from trainer.evaluation.features import bank_and_queries
from trainer.evaluation.knn import knn_accuracy
from trainer.launcher import mark_clean_stop
from trainer.models import build_model
from trainer.observability.logs import JsonlLog, memory_readings
from trainer.observability.metrics import TrainingMetrics
from trainer.parallel import ParallelDims


@dataclass
class TrainResult:
    state: TrainerState
    stopped_by: str  # "finished", "max_steps" or "sigterm"
    last_checkpoint: Path | None
    knn: dict[str, float] | None = None


class Trainer:
    def __init__(self, config: JobConfig, dims: ParallelDims, resume: str | None = None) -> None:
        self.config, self.dims = config, dims
        self.log = JsonlLog(config.logging.dir, dims.rank)
        manifest = ShardManifest.load(config.data.train_shards)
        loader_config = config.data.loader
        self.global_batch = loader_config.batch_size * dims.world_size
        peak_lr = scaled_lr(config.optim.base_lr, config.optim.base_batch, self.global_batch)

        reseed(config.seed, 0, 0)  # the same initial backbone on every rank
        model = build_model(config.model)
        ds_config = load_deepspeed_config(config.deepspeed_config, loader_config.batch_size)
        self.engine, self.backbone_optimizer = initialize_backbone(
            model, ds_config, peak_lr, config.optim.momentum, config.optim.weight_decay
        )
        self.dtype = engine_dtype(self.engine)

        method, section = config.method, config.classifier
        classifier_config = ClassifierConfig(
            num_classes=manifest.num_instances, feature_dim=config.model.feature_dim, temperature=section.temperature,
            chunk_size=section.chunk_size, mode=section.mode, smoothing_alpha=method.smoothing_alpha,
            smoothing_top_k=method.smoothing_top_k, smoothing_form=section.smoothing_form,
            init_std=section.init_std, init_seed=config.seed,
        )
        self.classifier = ShardedCosineClassifier(classifier_config, dims)
        self.classifier_optimizer = torch.optim.SGD(
            [self.classifier.weight], lr=peak_lr, momentum=config.optim.momentum,
            weight_decay=config.optim.weight_decay, fused=True,
        )

        self.train_loader = build_loader(config.data.train_shards, loader_config, dims.rank, dims.world_size,
                                         dims.device, train=True)
        self.steps_per_epoch = len(self.train_loader)
        total_steps = config.optim.epochs * self.steps_per_epoch
        self.schedule = LRSchedule(
            peak_lr=peak_lr, warmup_steps=round(config.optim.warmup_epochs * self.steps_per_epoch),
            total_steps=total_steps, min_lr=peak_lr * config.optim.min_lr_ratio,
        )

        self.state = TrainerState()
        self.hard_negatives: HardNegativeTable | None = None
        self.last_checkpoint = resolve_resume(resume, config.checkpoint.dir)
        if self.last_checkpoint is not None:
            self.state, table = load_checkpoint(self.last_checkpoint, self.engine, self.classifier,
                                                self.classifier_optimizer, dims, config.seed, log=self._say)
            if table is not None:
                self.hard_negatives = HardNegativeTable(table.to(dims.device), self.classifier.shard, self.classifier.group)
            self._say(f"resumed from {self.last_checkpoint} at epoch {self.state.epoch} step {self.state.global_step}")

        self.metrics = TrainingMetrics(dims.rank)
        self.metrics.shard_classes.set(self.classifier.num_classes_local)
        self.metrics.shard_bytes.set(self.classifier.weight.numel() * self.classifier.weight.element_size())
        self.metrics.steps_per_epoch.set(self.steps_per_epoch)
        self.metrics.epochs_planned.set(config.optim.epochs)
        if config.logging.metrics_port:
            self.metrics.serve(config.logging.metrics_port + dims.local_rank)
        self.stop_signal = StopSignal(dims.control_group)
        self.nonfinite = NonFiniteWatch(dims.device)

    # -- helpers ---------------------------------------------------------------------------

    def _say(self, message: str) -> None:
        self.log.write(event="message", message=message)
        if self.dims.rank == 0:
            tqdm.write(f"[instcls] {message}")

    def _save(self) -> Path:
        if self.last_checkpoint is not None and self.last_checkpoint.name == f"step_{self.state.global_step:09d}" \
                and self.last_checkpoint.parent == Path(self.config.checkpoint.dir):
            return self.last_checkpoint  # this step is already saved
        # ZeRO-3 keeps each rank's partition in ds_tensor; the check covers every rank's own part.
        local_parameters = [getattr(p, "ds_tensor", p) for p in self.engine.module.parameters()]
        self.nonfinite.observe_parameters([self.classifier.weight, *local_parameters])
        self.nonfinite.check(self.dims.control_group, self.state.global_step, str(self.last_checkpoint or ""))
        table = None if self.hard_negatives is None else self.hard_negatives.local_table
        self.last_checkpoint = save_checkpoint(
            self.config.checkpoint.dir, self.state, self.engine, self.classifier, self.classifier_optimizer, table,
            self.dims, self.config.checkpoint.keep,
        )
        self._say(f"saved {self.last_checkpoint}")
        return self.last_checkpoint

    def _smoothing_active(self, epoch: int) -> bool:
        method = self.config.method
        return method.smoothing_alpha > 0 and epoch >= method.smoothing_start_epoch

    def _refresh_hard_negatives(self, epoch: int) -> float:
        start = time.perf_counter()
        table = search_hard_negatives(self.classifier.weight.detach(), self.classifier.shard, self.classifier.group,
                                      self.config.method.smoothing_top_k)
        self.hard_negatives = HardNegativeTable(table, self.classifier.shard, self.classifier.group)
        self.state.hard_negatives_epoch = epoch
        return time.perf_counter() - start

    def _run_prior(self) -> None:
        start = time.perf_counter()
        loader = build_loader(self.config.data.train_shards, self.config.data.loader, self.dims.rank,
                              self.dims.world_size, self.dims.device, train=False)
        rows = contrastive_prior(self.engine, loader, self.classifier, self.dims, self.dtype)
        self.state.prior_done = True
        self._say(f"contrastive prior: wrote {rows} classifier rows in {time.perf_counter() - start:.1f}s")

    # -- the loop --------------------------------------------------------------------------

    def train(self) -> TrainResult:
        config, state = self.config, self.state
        if config.method.contrastive_prior and not state.prior_done and state.global_step == 0:
            self._run_prior()
        stopped_by = "finished"
        try:
            while state.epoch < config.optim.epochs:
                stopped_by = self._train_epoch()
                if stopped_by != "finished":
                    break
            else:
                self._save()
        finally:
            self.stop_signal.restore()
        knn = self.evaluate_knn() if stopped_by == "finished" and config.eval.knn_at_end else None
        self.log.close()
        return TrainResult(state=state, stopped_by=stopped_by, last_checkpoint=self.last_checkpoint, knn=knn)

    def _train_epoch(self) -> str:
        config, state, dims = self.config, self.state, self.dims
        epoch = state.epoch
        self.metrics.epoch.set(epoch)
        search_seconds = 0.0
        if self._smoothing_active(epoch) and state.hard_negatives_epoch != epoch:
            search_seconds = self._refresh_hard_negatives(epoch)
        use_smoothing = self._smoothing_active(epoch) and self.hard_negatives is not None
        self.engine.train()
        self.train_loader.set_epoch(epoch)
        skip = state.step_in_epoch  # batches of this epoch done before a restart
        bar = tqdm(total=self.steps_per_epoch, initial=skip, desc=f"epoch {epoch}", disable=not (
            config.logging.progress and dims.rank == 0), unit="step")
        epoch_start = window_start = time.perf_counter()
        window_images, window_wait = 0, 0.0
        wait_start = time.perf_counter()
        for index, batch in enumerate(self.train_loader):
            if index < skip:
                wait_start = time.perf_counter()
                continue
            if config.max_steps is not None and state.global_step >= config.max_steps:
                self._save()
                bar.close()
                return "max_steps"
            data_wait = time.perf_counter() - wait_start
            step_start = time.perf_counter()
            log_step = (state.global_step + 1) % config.logging.log_every == 0 or state.global_step == 0
            loss = self._step(batch, use_smoothing, validate=log_step)
            state.global_step += 1
            state.step_in_epoch += 1
            step_seconds = time.perf_counter() - step_start

            images = batch.instance_ids.shape[0]
            self.metrics.samples.inc(images)
            self.metrics.data_wait.inc(data_wait)
            self.metrics.step_duration.observe(step_seconds + data_wait)
            self.metrics.epoch_progress.set(state.step_in_epoch / self.steps_per_epoch)
            window_images += images
            window_wait += data_wait
            bar.update(1)
            if log_step:
                self._log_step(loss, window_images / (time.perf_counter() - window_start), window_wait)
                window_start, window_images, window_wait = time.perf_counter(), 0, 0.0
            every = config.checkpoint.every_steps
            if every and state.global_step % every == 0:
                self._save()
            if self.stop_signal.agreed():
                self._say(f"SIGTERM: saving at step {state.global_step} and exiting")
                self._save()
                mark_clean_stop(dims.rank)
                bar.close()
                return "sigterm"
            wait_start = time.perf_counter()
        bar.close()
        epoch_seconds = time.perf_counter() - epoch_start
        self.log.write(event="epoch", epoch=epoch, seconds=round(epoch_seconds, 3),
                       hard_negative_search_seconds=round(search_seconds, 3),
                       search_over_epoch=round(search_seconds / max(epoch_seconds, 1e-9), 4))
        if search_seconds:
            self._say(f"epoch {epoch}: hard-negative search {search_seconds:.2f}s = "
                      f"{100 * search_seconds / epoch_seconds:.1f}% of the epoch's {epoch_seconds:.1f}s")
        state.epoch += 1
        state.step_in_epoch = 0
        if config.checkpoint.every_epochs and state.epoch % config.checkpoint.every_epochs == 0:
            self._save()
        return "finished"

    def _step(self, batch, use_smoothing: bool, validate: bool) -> torch.Tensor:
        lr = self.schedule.lr_at(self.state.global_step)
        set_lr(self.backbone_optimizer, lr)
        set_lr(self.classifier_optimizer, lr)
        self.metrics.lr.set(lr)
        # Views of one size share a forward pass (multi-crop small views get their own).
        features, sizes = [], {}
        for view in batch.views:
            sizes.setdefault(view.shape[-1], []).append(view)
        for group in sizes.values():
            features.append(self.engine(torch.cat(group).to(self.dtype)))
        features = torch.cat(features)
        num_views = len(batch.views)
        ids = batch.instance_ids.repeat(num_views)
        hard = None
        if use_smoothing:
            hard = self.hard_negatives.lookup(batch.instance_ids).repeat(num_views, 1)
        loss = self.classifier(features, ids, hard, validate=validate)
        self.engine.backward(loss)
        self.engine.step()
        self.classifier.reduce_weight_grad()
        self.classifier_optimizer.step()
        self.classifier_optimizer.zero_grad(set_to_none=True)
        self.nonfinite.observe(loss)
        return loss.detach()

    def _log_step(self, loss: torch.Tensor, images_per_second: float, data_wait: float) -> None:
        self.nonfinite.check(self.dims.control_group, self.state.global_step, str(self.last_checkpoint or ""))
        loss_value = float(loss)
        memory = memory_readings(self.dims.device)
        comm = self.classifier.comm_timer.drain()
        self.metrics.loss.set(loss_value)
        self.metrics.set_memory(memory)
        self.metrics.comm.inc(comm)
        self.log.write(event="step", epoch=self.state.epoch, step=self.state.global_step, loss=round(loss_value, 5),
                       lr=self.schedule.lr_at(self.state.global_step - 1), images_per_s=round(images_per_second, 2),
                       data_wait_s=round(data_wait, 4), classifier_comm_s=round(comm, 4), memory_bytes=memory)

    # -- evaluation ------------------------------------------------------------------------

    def evaluate_knn(self) -> dict[str, float] | None:
        """kNN accuracy of the trained network and of the same network at its random init."""
        data, ev = self.config.data, self.config.eval
        if data.eval_shards is None:
            return None
        trained = plain_model_from_engine(self.engine, build_model(self.config.model)).to(self.dims.device)
        reseed(self.config.seed, 0, 0)
        random_init = build_model(self.config.model).to(self.dims.device)
        results = {}
        for name, model in (("trained", trained), ("random_init", random_init)):
            bank, bank_labels, queries, query_labels = bank_and_queries(model, data, self.dims)
            results[name] = knn_accuracy(bank, bank_labels, queries, query_labels, ev.knn_k, ev.knn_temperature)
        self.log.write(event="knn", **results)
        if self.dims.rank == 0:
            print(f"kNN accuracy (k={ev.knn_k}, cosine, held-out split): trained {100 * results['trained']:.2f}%  "
                  f"random init {100 * results['random_init']:.2f}%")
        return results
