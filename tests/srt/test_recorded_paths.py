"""spexis_sglang.testing.repo_relative / recorded_args: results never record a machine's paths."""

import os

from spexis_sglang.testing import recorded_args, repo_relative


def test_paths_inside_the_checkout_are_relative_outside_by_name(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    (repo / "benchmark" / "results").mkdir(parents=True)
    monkeypatch.chdir(repo)
    inside = str(repo / "benchmark" / "results" / "x.json")
    assert repo_relative(inside) == os.path.join("benchmark", "results", "x.json")
    assert repo_relative("benchmark/results/x.json") == os.path.join(
        "benchmark", "results", "x.json"
    )
    assert repo_relative(str(tmp_path / "elsewhere" / "out.json")) == "out.json"
    # a sibling whose name starts like the checkout's is outside it
    assert repo_relative(str(tmp_path / "repo2" / "y.json")) == "y.json"


def test_command_lines_keep_everything_but_absolute_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["--batches", "64", "--server-args", "--dtype bfloat16", "--out", "/srv/out/r.json"]
    argv += ["--head", str(tmp_path / "heads" / "h")]
    assert recorded_args(argv) == argv[:5] + ["r.json", "--head", os.path.join("heads", "h")]
