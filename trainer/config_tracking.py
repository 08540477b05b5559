"""The settings of run tracking in MLflow: ``logging.mlflow`` in a job config.

In the config layer, beside the job config that holds them; ``trainer.observability.mlflow_sink``
reads them.  Torch-free: the command line builds its parser from the config layer."""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass

from trainer.config_building import ConfigError


def mlflow_missing(environment_has=importlib.util.find_spec) -> str | None:
    """Why ``logging.mlflow.tracking_uri`` cannot be used here (the message names the fix), or None."""
    if environment_has("mlflow") is not None:
        return None
    return ("logging.mlflow.tracking_uri is set, but the MLflow client is not installed: "
            "pip install 'instcls[mlflow]' (the mlflow-skinny client), or leave logging.mlflow.tracking_uri empty")


@dataclass(frozen=True)
class MlflowSettings:
    """Attributes:
    tracking_uri: the MLflow tracking server (``http://mlflow.ml:5000``) or store (``file:/...``,
        ``sqlite:///...``) that rank 0 logs the run to; empty (the default): no MLflow.
    experiment: the experiment the run is created in (created when missing).
    run_name: the run's name in MLflow; empty: the name of the run's log folder.
    request_timeout_s: seconds one request to the server may take before it is given up.
    retries: retries of a request that failed (no answer, or 429/5xx): the second waits 2 s, the third
        4 s ..., each up to 1 s more (a server's Retry-After is not obeyed).  A request therefore
        gives up within ``warning_bound_s`` seconds (18 s with the defaults); the first one that does
        costs one warning, and training never waits for the server
        (``trainer.observability.mlflow_sink``).
    """

    tracking_uri: str = ""
    experiment: str = "instcls"
    run_name: str = ""
    request_timeout_s: float = 5.0
    retries: int = 2

    def __post_init__(self) -> None:
        if not isinstance(self.tracking_uri, str):
            raise ConfigError(f"logging.mlflow.tracking_uri={self.tracking_uri!r} is invalid: use a URI such as "
                              "http://mlflow.ml:5000, or an empty string for no MLflow")
        if not isinstance(self.experiment, str) or not self.experiment.strip():
            raise ConfigError(f"logging.mlflow.experiment={self.experiment!r} is invalid: use an experiment's "
                              "name, such as instcls")
        if not isinstance(self.run_name, str):
            raise ConfigError(f"logging.mlflow.run_name={self.run_name!r} is invalid: use a name, or an empty "
                              "string for the log folder's name")
        timeout = self.request_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 600 \
                or math.isnan(timeout):
            raise ConfigError(f"logging.mlflow.request_timeout_s={timeout!r} is invalid: use seconds in (0, 600], "
                              "such as 5")
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or not 0 <= self.retries <= 10:
            raise ConfigError(f"logging.mlflow.retries={self.retries!r} is invalid: use a count in [0, 10], such as 2")
        if self.enabled and (missing := mlflow_missing()) is not None:
            raise ConfigError(missing)

    @property
    def enabled(self) -> bool:
        return bool(self.tracking_uri.strip())

    @property
    def warning_bound_s(self) -> float:
        """The longest a request can take before it is given up: every try's timeout, and the back-off
        sleeps before the second and later retries (2, 4, 8 ... s, at most 120) with their jitter."""
        sleeps = sum(min(2 ** (retry - 1), 120) + 1 for retry in range(2, self.retries + 1))
        return (self.retries + 1) * self.request_timeout_s + sleeps
