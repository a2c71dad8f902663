"""verl's own launch scripts (tests/data/verl-examples) through ``init`` + ``validate``: each is
accepted, or refused in one line whose reason docs/verl-examples.md states; the table and the
code cannot drift apart.

Per script: init (bash reads it with stand-ins, the study is built and written), the study
loaded, and validate: the rules, every stage built, the baseline and each stage's two extreme
configs through verl's compose and validation (~1-4 s a script; the samples in depth are
``test_stage_configs.py``'s)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from support import verl_examples as V
from verl_sweep.verl_knowledge import verl_available

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = [pytest.mark.verl, pytest.mark.timeout(300),
              pytest.mark.skipif(not verl_available(), reason="verl is not installed")]

#: the share of the corpus validate accepts (docs/verl-examples.md; the 90% asked is not met:
#: the 11 refused scripts do not run on verl 0.9.1 as written)
MIN_ACCEPTED = 80


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return V.hf_cache(tmp_path_factory.mktemp("hf"))


def test_the_table_lists_every_script() -> None:
    rows = V.documented()
    assert sorted(rows) == V.SCRIPTS
    assert len(V.SCRIPTS) == 91
    assert sum(accepted for accepted, _ in rows.values()) >= MIN_ACCEPTED
    assert all(phrase for accepted, phrase in rows.values() if not accepted)


@pytest.mark.parametrize("script", V.SCRIPTS)
def test_init_and_validate(script: str, hub: Path, tmp_path: Path) -> None:
    accepted, phrase = V.documented()[script]
    outcome = V.init_and_validate(script, hub, tmp_path, n_samples=0)
    if accepted:
        assert outcome.accepted, outcome.line
        return
    assert not outcome.accepted, f"{script} is accepted now: update docs/verl-examples.md"
    assert "\n" not in outcome.line and phrase in outcome.line, outcome.line
