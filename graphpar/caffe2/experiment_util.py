"""Caffe2's `experiment_util.ModelTrainerLog`: a CSV-like log of a training run, one line per `log` call.

The file `<expname>_<YYYYmmdd_HHMMSS>.log` in the working directory starts with `# <runtime args>`,
then a header line (the column names, fixed by the first `log`) and one line of comma-separated values
per call: time spent since the previous call and in all, inputs since the previous call and in all,
the batch count, inputs per second, then the caller's values sorted by name. Each line also goes to
the `experiment_logger` logger.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("experiment_logger")


class ModelTrainerLog:
    """Writes the log of one experiment (Caffe2's class of the same name)."""

    def __init__(self, expname: str, runtime_args: Any, external_loggers: list | None = None) -> None:
        now = datetime.datetime.fromtimestamp(time.time())
        self.experiment_id = f"{expname}_{now.strftime('%Y%m%d_%H%M%S')}"
        self.filename = f"{self.experiment_id}.log"
        self.headers: list[str] | None = None
        self.start_time = self.last_time = time.time()
        self.last_input_count = 0
        self.external_loggers = list(external_loggers or [])
        self.logstr(f"# {runtime_args}")

    def logstr(self, line: str) -> None:
        """Append `line` to the file and to the `experiment_logger` logger."""
        with open(self.filename, "a") as file:
            file.write(line + "\n")
        log.info(line)

    def log(self, input_count: int, batch_count: int, additional_values: Mapping[str, Any]) -> dict[str, Any]:
        """Log one line; returns its values by column.

        Raises:
            ValueError: `additional_values` has other names than the first call's (the header is fixed).
        """
        now = time.time()
        delta_t, delta_count = now - self.last_time, input_count - self.last_input_count
        self.last_time, self.last_input_count = now, input_count
        values = {"time_spent": delta_t, "cumulative_time_spent": now - self.start_time, "input_count": delta_count,
                  "cumulative_input_count": input_count, "cumulative_batch_count": batch_count,
                  "inputs_per_sec": delta_count / delta_t if delta_t > 0 else 0.0}
        values.update((k, additional_values[k]) for k in sorted(additional_values))
        if self.headers is None:
            self.headers = list(values)
            self.logstr(",".join(self.headers))
        elif list(values) != self.headers:
            raise ValueError(f"ModelTrainerLog.log: the columns {list(values)} differ from the first line's "
                             f"{self.headers}; log the same additional_values every time")
        self.logstr(",".join(str(v) for v in values.values()))
        for logger in self.external_loggers:
            logger.log(values)
        return values
