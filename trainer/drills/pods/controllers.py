"""What the controllers do with a pod that ended, played from the manifest's own policy.

- ``batch/v1`` Job (Kubernetes 1.33, ``pkg/controller/job``): exit 0 completes the pod's index;
  otherwise the ``podFailurePolicy`` rules apply in order, first match wins (``onPodConditions``
  ``DisruptionTarget``, ``onExitCodes`` ``In``/``NotIn`` on the named container): ``Ignore``
  (replaced, not counted), ``FailJob``, ``FailIndex``, ``Count``; no match counts.  A counted
  failure beyond ``backoffLimitPerIndex`` fails the index, more failed indexes than
  ``maxFailedIndexes`` fail the Job (the harness plays 0 only: one failed index fails a gang), and so
  do more counted failures than ``backoffLimit``.
  ``podReplacementPolicy: Failed``: the replacement starts once the old pod has ended.  The Job
  succeeds when every index has, or when a ``successPolicy`` rule's ``succeededCount`` is reached
  (the other pods are then terminated).
- JobSet (v0.8, under a Trainer v2 TrainJob): a failed Job fails the JobSet when its reason matches a
  ``failurePolicy`` rule with ``FailJobSet`` (a Job failed by its ``podFailurePolicy`` has reason
  ``PodFailurePolicy``); otherwise the whole JobSet is recreated, up to ``maxRestarts``.
- training-operator v1.9's ``restartPolicy: ExitCode``: 1-127 fail the job, 128-255 (and a pod
  deleted under it) recreate the pod, uncounted.  The job succeeds when the master does, or,
  without one, when every worker has (an elastic job: when any worker has).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Action(Enum):
    REPLACE = "replaced, not counted"
    REPLACE_COUNTED = "replaced, counted"
    SUCCEEDED = "succeeded"
    FAIL_JOB = "the job failed"
    RESTART_ALL = "every pod recreated (JobSet restart)"


@dataclass(frozen=True)
class PodEnd:
    index: int  # position in the workload's pod list
    code: int  # the container's exit code (128 + signal for a signalled one)
    disrupted: bool = False  # the pod carried the DisruptionTarget condition (preemption, eviction)
    deleted: bool = False  # the pod object was deleted (kubectl delete pod, a lost node)


@dataclass
class Verdict:
    action: Action
    reason: str


@dataclass
class JobController:
    """The Job's books: counted failures per index, the indexes done."""

    policy: dict
    container: str
    succeeded: set[int] = field(default_factory=set)
    failures: dict[int, int] = field(default_factory=dict)

    def _rule(self, end: PodEnd) -> str | None:
        for rule in self.policy.get("podFailurePolicy", {}).get("rules", []):
            if "onPodConditions" in rule:
                if end.disrupted and any(c.get("type") == "DisruptionTarget" and c.get("status", "True") == "True"
                                         for c in rule["onPodConditions"]):
                    return rule["action"]
            elif "onExitCodes" in rule:
                codes = rule["onExitCodes"]
                if codes.get("containerName", self.container) != self.container:
                    continue
                inside = end.code in codes["values"]
                if inside == (codes["operator"] == "In"):
                    return rule["action"]
        return None

    def judge(self, end: PodEnd) -> Verdict:
        if end.code == 0:
            self.succeeded.add(end.index)
            return Verdict(Action.SUCCEEDED, "exit 0: the index completed")
        rule = self._rule(end)
        if rule == "Ignore":
            disrupted = " (disrupted)" if end.disrupted else ""
            return Verdict(Action.REPLACE, f"exit {end.code}{disrupted}: podFailurePolicy Ignore")
        if rule == "FailJob":
            return Verdict(Action.FAIL_JOB, f"exit {end.code}: podFailurePolicy FailJob (reason PodFailurePolicy)")
        self.failures[end.index] = self.failures.get(end.index, 0) + 1
        per_index = self.policy.get("backoffLimitPerIndex")
        failed_indexes = sum(1 for count in self.failures.values() if per_index is not None and count > per_index)
        if rule == "FailIndex" or failed_indexes > self.policy.get("maxFailedIndexes", 0):
            return Verdict(Action.FAIL_JOB, f"exit {end.code}: index {end.index} failed {self.failures[end.index]} "
                                            "times (reason FailedIndexes / MaxFailedIndexesExceeded)")
        if sum(self.failures.values()) > self.policy.get("backoffLimit", 6):
            return Verdict(Action.FAIL_JOB, f"exit {end.code}: backoffLimit exceeded (reason BackoffLimitExceeded)")
        return Verdict(Action.REPLACE_COUNTED, f"exit {end.code}: counted ({self.failures[end.index]} of index "
                                               f"{end.index}'s {per_index})")

    def done(self, pods: int) -> bool:
        for rule in self.policy.get("successPolicy", {}).get("rules", []):
            if "succeededCount" in rule and len(self.succeeded) >= rule["succeededCount"]:
                return True
        return len(self.succeeded) >= pods


@dataclass
class JobSetController:
    """A JobSet of one Job (the TrainJob's ``node``): restarts the whole set on a Job failure."""

    job: JobController
    policy: dict
    restarts: int = 0

    def judge(self, end: PodEnd) -> Verdict:
        verdict = self.job.judge(end)
        if verdict.action is not Action.FAIL_JOB:
            return verdict
        reason = "PodFailurePolicy" if "PodFailurePolicy" in verdict.reason else "other"
        for rule in self.policy.get("rules", []):
            if rule.get("action") == "FailJobSet" and reason in rule.get("onJobFailureReasons", [reason]):
                return Verdict(Action.FAIL_JOB, f"{verdict.reason}; JobSet failurePolicy rule {rule.get('name')}: "
                                                "FailJobSet")
        if self.restarts < self.policy.get("maxRestarts", 0):
            self.restarts += 1
            self.job.failures.clear()
            self.job.succeeded.clear()
            return Verdict(Action.RESTART_ALL, f"{verdict.reason}; JobSet restart {self.restarts} of "
                                               f"{self.policy.get('maxRestarts')}")
        return Verdict(Action.FAIL_JOB, f"{verdict.reason}; JobSet maxRestarts used up")

    def done(self, pods: int) -> bool:
        return self.job.done(pods)


@dataclass
class PyTorchJobController:
    policy: dict
    roles: list[str]  # each pod's role, by position
    succeeded: set[int] = field(default_factory=set)

    def judge(self, end: PodEnd) -> Verdict:
        if end.code == 0:
            self.succeeded.add(end.index)
            return Verdict(Action.SUCCEEDED, "exit 0")
        if end.deleted or end.disrupted:
            return Verdict(Action.REPLACE, f"exit {end.code}: the pod was deleted; the operator recreates it")
        if 128 <= end.code <= 255:
            return Verdict(Action.REPLACE, f"exit {end.code}: restartPolicy ExitCode retries 128-255")
        return Verdict(Action.FAIL_JOB, f"exit {end.code}: restartPolicy ExitCode fails the job on 1-127")

    def done(self, pods: int) -> bool:
        if self.policy["master"]:
            return any(self.roles[i] == "master" for i in self.succeeded)
        if self.policy["elastic"]:
            return bool(self.succeeded)
        return len(self.succeeded) >= pods


def controller_of(workload) -> JobController | JobSetController | PyTorchJobController:
    if workload.kind == "PyTorchJob":
        return PyTorchJobController(workload.policy["pytorchjob"], [pod.role for pod in workload.pods])
    job = JobController(workload.policy["job"], workload.pods[0].container["name"])
    return JobSetController(job, workload.policy["jobset"]) if workload.kind == "TrainJob" else job
