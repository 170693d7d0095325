"""The launcher (torchrun) environment -> ParallelConfig, in the one module that reads it."""

import argparse

import pytest

from hearth.flags import add_engine_args, engine_config
from hearth.flags import torchrun_env as _torchrun_env

TORCHRUN = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "10.0.0.7",
            "MASTER_PORT": "29511", "TORCHELASTIC_USE_AGENT_STORE": "True"}


def parse(argv: list[str], environ: dict) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    a = parser.parse_args(argv)
    a.launcher = _torchrun_env(environ)
    return a


def test_alone_spawns_its_own_ranks():
    assert _torchrun_env({}) is None
    assert _torchrun_env({"RANK": "0", "WORLD_SIZE": "1"}) is None
    pc = engine_config(parse(["-tp", "2", "--num-micro-batches", "3"], {})).parallel
    assert (pc.tensor_parallel_size, pc.num_micro_batches, pc.master_addr) == (2, 3, None)


def test_torchrun_env_becomes_the_rendezvous():
    pc = engine_config(parse(["-tp", "2", "-pp", "2", "--collective-timeout", "9"],
                             TORCHRUN)).parallel
    assert (pc.master_addr, pc.master_port, pc.agent_store) == ("10.0.0.7", 29511, True)
    assert pc.collective_timeout_s == 9.0 and pc.world_size == 4
    assert _torchrun_env({**TORCHRUN, "RANK": "3", "LOCAL_RANK": "1"})["local_rank"] == 1


def test_world_size_must_match_the_layout():
    with pytest.raises(ValueError, match=r"the launcher started 4 processes, but "
                                         r"--tensor-parallel-size x --pipeline-parallel-size is 2"):
        engine_config(parse(["-tp", "2"], TORCHRUN))
