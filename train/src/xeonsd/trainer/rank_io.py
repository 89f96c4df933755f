"""What a rank has before its job does: its status file (``status/rank-<r>.json``, in state ``starting``) and its
log lines' prefix (``[rank r/world]``; library chatter from rank 0 only)."""

from __future__ import annotations

import logging
import os
import time

from xeonsd.cluster.distributed import node_address
from xeonsd.cluster.launch import RankInfo
from xeonsd.cluster.rank_stats import node_names
from xeonsd.contracts.job_status import RankStatus, StatusFileError, attempt_from_env
from xeonsd.jobs.status_file import RankStatusFile
from xeonsd.trainer.config import ConfigError, TrainConfig


def start_status(cfg: TrainConfig, info: RankInfo) -> RankStatusFile:
    """This rank's status file (``<output_dir>/status/rank-<r>.json`` on its own node), in state ``starting``."""
    try:
        attempt = attempt_from_env()
    except StatusFileError as exc:
        raise ConfigError(str(exc)) from exc
    address = node_address()
    status = RankStatus(
        rank=info.rank,
        world=info.world_size,
        node=node_names().get(address, address),
        address=address,
        pid=os.getpid(),
        state="starting",
        step=0,
        updated=time.time(),
        attempt=attempt,
    )
    return RankStatusFile(cfg.output_path, status)


class _RankFilter(logging.Filter):
    def __init__(self, rank: int, world: int) -> None:
        super().__init__()
        self.prefix = f"[rank {rank}/{world}]"

    def filter(self, record: logging.LogRecord) -> bool:
        record.rankprefix = self.prefix
        return True


def setup_logging(info: RankInfo) -> None:
    """Every log line with its rank in the prefix; library chatter only from rank 0."""
    root = logging.getLogger()
    for h in root.handlers:
        h.addFilter(_RankFilter(info.rank, info.world_size))
        h.setFormatter(logging.Formatter("%(asctime)s %(rankprefix)s %(levelname)s %(name)s: %(message)s"))
    # Library chatter (loading bars, warnings about unused processors) only from rank 0.
    if not info.is_main:
        for name in ("diffusers", "transformers", "peft"):
            logging.getLogger(name).setLevel(logging.ERROR)
