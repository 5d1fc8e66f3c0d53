"""The cited experiments as one command line: tables, JSON and CSV."""

from __future__ import annotations

import csv
import json

import pytest

from kvlab.bench.__main__ import main
from kvlab.bench.reproduce import EXPERIMENTS, format_table, save_rows


def test_every_chapter_with_a_published_figure_has_an_experiment():
    assert {e.chapter for e in EXPERIMENTS.values()} == {"01", "02", "03", "04", "05", "06"}


def test_table_json_and_csv_keep_every_row_and_column(tmp_path):
    rows = [{"server": "default", "concurrency": 1, "spread": [1.5, 2.0]},
            {"server": "max_num_seqs=1", "concurrency": 16, "identical": True}]
    table = format_table(rows).splitlines()
    assert table[0].split() == ["server", "concurrency", "spread", "identical"]
    assert len(table) == 2 + len(rows) and "max_num_seqs=1" in table[3]
    json_path, csv_path = save_rows(rows, tmp_path / "out", "demo")
    assert json.loads(json_path.read_text()) == rows
    with csv_path.open() as f:
        back = list(csv.DictReader(f))
    assert back[0] == {"server": "default", "concurrency": "1", "spread": "[1.5, 2.0]",
                       "identical": ""}
    assert back[1]["identical"] == "true"


@pytest.mark.slow
def test_cli_runs_an_experiment_on_the_real_model_and_saves_it(tmp_path, capsys):
    main(["reproduce", "paged-admission", "--repeats", "1", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert "== paged-admission (chapter 01) ==" in printed
    rows = json.loads((tmp_path / "paged-admission.json").read_text())
    real = {r["kv_layout"]: r for r in rows if r["run"].startswith("real model")}
    # 2,560 tokens hold 5 contiguous reservations of max_model_len=512, and all 16 when paged.
    assert real["contiguous"]["peak_running"] == 5 and real["paged"]["peak_running"] == 16
    assert real["paged"]["identical_to_contiguous"] is True
    sims = [r for r in rows if r["run"] == "simulation seed 0"]
    # The same 100 requests: paged (vLLM's admission) finishes them in about half the steps.
    assert sims[0]["kv_layout"] == "contiguous" and sims[1]["kv_layout"] == "paged"
    assert sims[0]["steps_to_finish"] > 1.8 * sims[1]["steps_to_finish"]
    assert sims[1]["mean_running"] > 1.8 * sims[0]["mean_running"]
    assert (tmp_path / "paged-admission.csv").is_file()


def test_cli_refuses_an_unknown_experiment(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["reproduce", "continuous-batchin"])
    assert exc.value.code == 2
    assert "unknown experiment" in capsys.readouterr().err
