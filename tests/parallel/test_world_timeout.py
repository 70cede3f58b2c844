"""The collectives' timeout setting reaches the process group of a launched world."""

from __future__ import annotations

import contextlib
import datetime

from megatron_iso.parallel import world
from megatron_iso.settings import config_world
from megatron_iso.settings.compose import load_config


def test_dist_timeout_s_reaches_init_process_group(monkeypatch):
    seen = {}

    @contextlib.contextmanager
    def fake_world(init, *args, **kwargs):
        seen.update(init)
        yield

    monkeypatch.setattr(world, "megatron_world", fake_world)
    monkeypatch.setattr(world.dist, "get_rank", lambda: 0)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(world.torch.cuda, "is_available", lambda: False)
    with config_world(load_config(["dist_timeout_s=42"])) as rank:
        assert rank == 0
    assert seen["timeout"] == datetime.timedelta(seconds=42)
