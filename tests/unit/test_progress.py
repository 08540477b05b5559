"""Progress off a terminal: plain lines, rate-limited, with an ETA from the pace so far."""

import io

from trainer.observability.progress import ProgressLines, epoch_bar


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_lines_come_at_most_every_period_with_the_eta_of_the_pace_so_far():
    clock, lines = FakeClock(), []
    progress = ProgressLines(total_steps=1000, steps_per_epoch=250, every_s=30, write=lines.append, clock=clock)
    progress.log_step(epoch=0, step_in_epoch=10, global_step=10, loss=6.5, images_per_s=800, data_wait_share=0.25)
    clock.now += 20  # 10 more steps in 20 s: too soon for a line
    progress.log_step(0, 20, 20, 6.4, 810, 0.0)
    clock.now += 20  # 10 more steps, 40 s after the first line
    progress.log_step(0, 30, 30, 6.25, 820, 0.03)
    assert len(lines) == 2
    assert lines[0] == "[instcls] epoch 0 step 10/250 (run 10/1000) | loss 6.5000 | 800.0 img/s | data wait 25% | ETA ?"
    # 21 steps (from the step before the first line) in 40 s: 970 steps left take 1848 s
    assert lines[1].endswith("| loss 6.2500 | 820.0 img/s | data wait 3% | ETA 0:30:48"), lines[1]


def test_every_log_step_prints_with_a_zero_period_and_a_bar_needs_a_terminal():
    lines = []
    progress = ProgressLines(total_steps=8, steps_per_epoch=4, every_s=0, write=lines.append, clock=FakeClock())
    for step in range(1, 9):
        progress.log_step(epoch=(step - 1) // 4, step_in_epoch=(step - 1) % 4 + 1, global_step=step, loss=1.0,
                          images_per_s=1.0, data_wait_share=0.0)
    assert [line.split(" |")[0] for line in lines[3:5]] == ["[instcls] epoch 0 step 4/4 (run 4/8)",
                                                             "[instcls] epoch 1 step 1/4 (run 5/8)"]
    assert len(lines) == 8
    stream = io.StringIO()  # not a terminal: the bar stays silent
    bar = epoch_bar(total=4, initial=0, epoch=0, enabled=True, stream=stream)
    bar.update(4)
    bar.close()
    assert stream.getvalue() == ""
