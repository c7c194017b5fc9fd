"""The objectives as plug-ins (``toolkit/objectives/``): every ``train.objective`` choice has its module and every
module's objective is a choice; the engines and the trainer call the protocol and name no objective."""
from __future__ import annotations

import re
import typing

from tests.helpers.runs import REPO


def test_every_objective_choice_has_its_module_and_back():
    from toolkit.config import TrainConfig
    from toolkit.objectives import registered
    choices = set(typing.get_args(TrainConfig.model_fields["objective"].annotation))
    assert set(registered()) == choices == {"sft", "dpo", "orpo"}


def test_the_engines_and_the_trainer_name_no_objective():
    """Issue 42's acceptance: no file under toolkit/adapters/ or the trainer names DPO (nor ORPO): each is
    decided once, in the plan (``Plan.objective``), and called through the protocol."""
    from toolkit.objectives import registered
    names = re.compile(r"\b(" + "|".join(n for n in registered() if n != "sft") + r")\b", re.IGNORECASE)
    files = [*(REPO / "toolkit" / "adapters").rglob("*.py"), REPO / "toolkit" / "train" / "trainer.py",
             REPO / "toolkit" / "engine.py"]
    found = {str(p.relative_to(REPO)): names.findall(p.read_text()) for p in files}
    assert {k: v for k, v in found.items() if v} == {}
