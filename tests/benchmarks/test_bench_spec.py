"""bench_spec's command line: the flags it shares with the engine are checked before
any model loads, and the one engine value that means nothing there is refused by name."""

from __future__ import annotations

import pytest

from pagedserve.benchmarks import bench_spec


@pytest.mark.parametrize("value, message", [
    ("off", "bench_spec runs speculation off beside the method"),  # (it crashed: json.loads("off"))
    ("{bad", "speculative_config must be a JSON object"),
])
def test_a_speculative_config_it_cannot_compare_is_a_usage_error(value, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_spec.main(["--speculative-config", value, "--workloads", "edit-code"])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
