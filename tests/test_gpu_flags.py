"""jaxpar's GPU XLA_FLAGS (jaxpar/env.py): the pipelined collectives MaxText runs with, set where a command compiles
for a GPU, never on CPU, never over the user's own setting; lab 05 compiles with and without them."""
import argparse
import os

from jaxpar.env import PIPELINED_COLLECTIVES, compiles_for_gpu, start_platform, with_gpu_defaults
from jaxpar.labs.overlap import lab


def test_defaults_are_added_and_the_users_setting_wins():
    assert with_gpu_defaults("").split() == [f"{flag}=true" for flag in PIPELINED_COLLECTIVES]
    mine = "--xla_gpu_enable_pipelined_all_gather=false --xla_dump_to=/tmp/x"
    flags = with_gpu_defaults(mine).split()
    assert flags[:2] == mine.split() and "--xla_gpu_enable_pipelined_all_gather=true" not in flags
    assert len(flags) == 2 + len(PIPELINED_COLLECTIVES) - 1


def test_only_gpu_compiles_get_them(tmp_path, monkeypatch):
    bare, gpu = tmp_path / "bare", tmp_path / "gpu"
    bare.mkdir()
    gpu.mkdir()
    (gpu / "nvidiactl").touch()
    assert not compiles_for_gpu({}, wants_cpu=False, dev=bare)
    assert compiles_for_gpu({}, wants_cpu=False, dev=gpu)
    assert not compiles_for_gpu({}, wants_cpu=True, dev=gpu)                      # --cpu-devices on a GPU machine
    assert not compiles_for_gpu({"JAX_PLATFORMS": "cpu"}, wants_cpu=False, dev=gpu)
    assert compiles_for_gpu({"JAX_PLATFORMS": "cpu"}, wants_cpu=True, gpu_target=True, dev=bare)   # deviceless H100
    for argv, gets in ((["plan", "--cpu-devices", "8", "--tokens", "1e6"], False),
                       (["dryrun", "--target", "h100"], True), (["dryrun"], False)):
        monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
        monkeypatch.delenv("JAX_PLATFORMS", raising=False)
        args = argparse.Namespace(subcommand=argv[0], cpu_devices=8 if "--cpu-devices" in argv else None,
                                  target=argv[2] if "--target" in argv else "cpu")
        start_platform(args)
        flags = os.environ["XLA_FLAGS"]
        assert all(f"{flag}=true" in flags for flag in PIPELINED_COLLECTIVES) == gets, argv
        assert ("pipelined" in flags) == gets, argv


def test_lab_09_compiles_with_and_without_them():
    runs = lab.gpu_runs(["fsdp (XLA)"])
    assert ("fsdp (XLA)", "scheduler on") in runs and ("fsdp (XLA)", "pipelined off") in runs
    on, off = lab.FLAGS["scheduler on"], lab.FLAGS["pipelined off"]
    assert all(f"{flag}=true" in on and f"{flag}=false" in off for flag in PIPELINED_COLLECTIVES)
    assert on.replace(lab.PIPELINED_ON, "") == off.replace(lab.PIPELINED_OFF, "")   # nothing else differs
