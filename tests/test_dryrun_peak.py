"""The dry run's CPU peak is the host's kept probe, the one `train` divides by (issue 28).

Before, every `jaxpar dryrun` probed anew: 17.4 then 89.4 GFLOP/s on two runs of the 7B on
a shared host, so two reports' compute times and MFU bounds did not compare.
"""
import dataclasses

from jaxpar.config import base_config
from jaxpar.measure import dryrun, hardware


def test_the_dry_runs_cpu_peak_is_kept_per_host_and_reprobed_on_request(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXPAR_CACHE", str(tmp_path))
    monkeypatch.delenv(hardware.REPROBE_ENV, raising=False)
    probes = iter([63.8e9, 35.8e9])
    host = hardware.Accelerator("cpu-host (test)", None, None, 0.0, None, None, None, None, None, "a test probe")
    monkeypatch.setattr(hardware, "probe_host", lambda: dataclasses.replace(host, fp32_flops=next(probes)))
    config, cpu = base_config(), {"platform": "cpu"}
    first, source = dryrun._peak_flops(config, cpu, 8)
    assert first == 63.8e9 / 8 and "probed now and kept in" in source
    second, source = dryrun._peak_flops(config, cpu, 8)                  # a busier host: not probed again
    assert second == first and "kept from this host's probe of" in source, source
    monkeypatch.setenv(hardware.REPROBE_ENV, "1")
    assert dryrun._peak_flops(config, cpu, 8)[0] == 35.8e9 / 8
