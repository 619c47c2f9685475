"""``trainer.resume_from=auto`` needs the run directory: asked without one, resume_point says so."""

from __future__ import annotations

import pytest

from cp_attention.training.config import resume_point


def test_auto_resume_without_a_run_directory_is_refused_by_name():
    cfg = {"trainer": {"resume_from": "auto"}}
    with pytest.raises(ValueError, match=r"resume_from=auto needs the run directory .* got run_dir=None"):
        resume_point(cfg, 1, None)


def test_auto_resume_with_an_empty_run_directory_starts_fresh(tmp_path, capsys):
    assert resume_point({"trainer": {"resume_from": "auto"}}, 1, tmp_path) is None
    assert "no complete checkpoint" in capsys.readouterr().err
