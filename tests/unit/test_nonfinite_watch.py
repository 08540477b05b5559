"""The check a save makes that the parameters are finite: it finds a NaN or an infinity anywhere in
them, and it costs no copy of them (on a CPU rank its temporaries were the peak of every save)."""

import pytest
import torch

from trainer.engine.stop_conditions import NonFiniteLossError, NonFiniteWatch
from trainer.observability.memory import peak_since, reset_peak

CPU = torch.device("cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), None])
def test_a_nan_or_an_infinity_in_any_parameter_stops_the_run(dtype, value):
    parameters = [torch.randn(50, 8, dtype=dtype), torch.empty(0, dtype=dtype), torch.randn(300, dtype=dtype)]
    if value is not None:
        parameters[2][217] = value
    watch = NonFiniteWatch(CPU)
    watch.observe_parameters(parameters)
    if value is None:
        watch.check(None, 7, None)  # finite: nothing raised
    else:
        with pytest.raises(NonFiniteLossError, match="became NaN or inf by step 7"):
            watch.check(None, 7, None)


def test_checking_the_parameters_adds_no_copy_of_them_to_the_peak_memory():
    weight = torch.randn(128 << 20 >> 2)  # 128 MiB of fp32 rows
    watch = NonFiniteWatch(CPU)
    baseline = reset_peak(CPU)
    watch.observe_parameters([weight])
    _, rise = peak_since(CPU, baseline)
    assert rise < 16 << 20, f"{rise / 2**20:.0f} MiB"  # torch.isfinite: |W| and three masks, ~224 MiB
    watch.check(None, 1, None)
