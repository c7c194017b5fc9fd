"""LoRA resolved against the model's own module names, once, in the plan: which modules get
adapters, which are trained in full, and how many parameters train. ``--dry-run``, the estimate
and every rank read this one resolution (``plan.lora``); ``lora/peft.py`` applies it with peft,
``lora/geometry.py`` lays it onto megatron's fused linears.

Names are HF module names as peft matches them: a target matches a module whose name equals it or
ends with ``.`` + it (``q_proj``, ``shared_expert.down_proj``). ``all-linear`` is every linear layer
(``nn.Linear``, GPT-2's ``Conv1D``) except the output layer and mixture-of-experts gates (the
router, the shared expert's gate). transformers packs routed experts as 3-D parameters of one
module, not as linear layers: LoRA does not adapt them, and a target naming them is refused.
"""
from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict

from toolkit.config import ConfigError, LoraConfig

ALL_LINEAR = "all-linear"


class LoraSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: int
    alpha: float
    dropout: float
    targets: list[str]
    """peft's ``target_modules``: the configured names, ``all-linear`` resolved to module names."""
    modules_to_save: list[str]
    adapted: int
    """Modules that get an adapter."""
    fan_in_fan_out: bool
    """The adapted layers store their weight as [in, out] (GPT-2's Conv1D)."""
    trainable: int
    """Adapter parameters (rank x (in + out) per adapted layer) plus the modules trained in full."""

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def is_linear(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"


def is_gate(name: str, module: torch.nn.Module) -> bool:
    """An MoE gate: the router (transformers 5: a ``*Router`` module; before: a Linear named
    ``gate``) or the shared expert's gate; adapting them changes which experts tokens reach."""
    last = name.rsplit(".", 1)[-1]
    return "Router" in type(module).__name__ or last == "gate" or last.endswith("_gate")


def matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def saved_matches(name: str, saved: str) -> bool:
    """peft's rule for ``modules_to_save`` (``peft.utils.other._set_trainable``): a plain suffix, so
    ``norm`` also names every ``input_layernorm`` (unlike ``target_modules``' dotted suffix)."""
    return name.endswith(saved)


def resolve_lora(cfg: LoraConfig, model: torch.nn.Module) -> LoraSpec:
    """``cfg`` checked against ``model`` (a meta-device model is enough: names and shapes only)."""
    names = _Names(model)
    targets = _resolved_targets(cfg.target_modules, names)
    adapted = {n: m for n, m in names.eligible.items() if any(matches(n, t) for t in targets)}
    saved = _modules_to_save(cfg.modules_to_save, names.modules, model)
    trainable = sum(cfg.rank * sum(_in_out(m)) for m in adapted.values())
    trainable += sum(p.numel() for n, m in names.modules.items() if any(saved_matches(n, s) for s in saved)
                     for p in m.parameters())
    return LoraSpec(rank=cfg.rank, alpha=cfg.alpha, dropout=cfg.dropout, targets=targets, modules_to_save=saved,
                    adapted=len(adapted), trainable=trainable,
                    fan_in_fan_out=any(type(m).__name__ == "Conv1D" for m in adapted.values()))


class _Names:
    """The model's modules by name; those LoRA may adapt; the output layer; packed experts' names."""

    def __init__(self, model: torch.nn.Module):
        from toolkit.families.vision import find_vision
        self.modules = dict(model.named_modules())
        out = model.get_output_embeddings()
        self.output = {n for n, m in self.modules.items() if m is out}
        vision = find_vision(getattr(model.config, "model_type", None))  # a VLM: never its vision tower
        self.tower = {n for n in self.modules if vision is not None and vision.is_tower(n)}
        self.eligible = {n: m for n, m in self.modules.items()
                         if is_linear(m) and not is_gate(n, m) and n not in self.output and n not in self.tower}
        self.packed = [f"{n}.{p}" for n, m in self.modules.items() for p, t in m.named_parameters(recurse=False)
                       if t.ndim == 3]

    def valid(self) -> str:
        """Eligible modules' last names (the last two where a packed parameter shares the last)."""
        packed_last = {p.rsplit(".", 1)[-1] for p in self.packed}
        names = {".".join(n.split(".")[-2:]) if n.rsplit(".", 1)[-1] in packed_last else n.rsplit(".", 1)[-1]
                 for n in self.eligible}
        return ", ".join(sorted(names)) or "none"


def _in_out(module: torch.nn.Module) -> tuple[int, int]:
    if isinstance(module, torch.nn.Linear):
        return module.in_features, module.out_features
    return tuple(module.weight.shape)  # Conv1D: [in, out]


def _resolved_targets(targets: list[str], names: _Names) -> list[str]:
    if not targets:
        raise ConfigError(f"lora.target_modules is empty; name modules ({names.valid()}) or {ALL_LINEAR}")
    if ALL_LINEAR in targets:
        if len(targets) > 1:
            raise ConfigError(f"lora.target_modules={targets}: {ALL_LINEAR} already names every linear layer; "
                              "give it alone or list the modules")
        if not names.eligible:
            raise ConfigError("lora.target_modules=all-linear: this model has no linear layer LoRA can adapt")
        return sorted({_unambiguous_suffix(n, names) for n in names.eligible})
    for target in targets:
        _check_target(target, names)
    return list(targets)


def _unambiguous_suffix(name: str, names: _Names) -> str:
    """The shortest dotted suffix of ``name`` that is a valid target (``down_proj``; but
    ``shared_expert.down_proj`` where the packed experts hold a ``down_proj`` too)."""
    parts = name.split(".")
    for i in range(len(parts) - 1, -1, -1):
        suffix = ".".join(parts[i:])
        try:
            _check_target(suffix, names)
            return suffix
        except ConfigError:
            continue
    return name


def _check_target(target: str, names: _Names) -> None:
    """A target must match linear layers only: not the output layer, a gate, or packed experts."""
    packed = [p for p in names.packed if matches(p, target) or matches(p.rsplit(".", 1)[0], target)]
    if packed:
        raise ConfigError(f"lora.target_modules: {target!r} names routed experts that transformers packs as "
                          f"3-D parameters ({', '.join(packed[:3])}), which LoRA does not adapt here; target "
                          f"linear layers instead ({names.valid()})")
    hits = [n for n in names.modules if matches(n, target)]
    if not hits:
        raise ConfigError(f"lora.target_modules: no module of this model is named {target!r}; valid names: "
                          f"{names.valid()} (or {ALL_LINEAR})")
    wrong = [n for n in hits if n not in names.eligible]
    if wrong:
        module = names.modules[wrong[0]]
        what = ("the output layer (train it in full: lora.modules_to_save)" if wrong[0] in names.output
                else "a layer of the vision tower, which stays frozen under LoRA (adapters go on the language "
                     "model and the projector)" if wrong[0] in names.tower
                else "an MoE gate (router), which LoRA never adapts" if is_gate(wrong[0], module)
                else f"a {type(module).__name__}, not a linear layer")
        raise ConfigError(f"lora.target_modules: {target!r} matches {wrong[0]}, {what}; valid names: "
                          f"{names.valid()}")


def _modules_to_save(names: list[str], modules: dict, model: torch.nn.Module) -> list[str]:
    tied = model.get_input_embeddings().weight is model.get_output_embeddings().weight
    embeddings = {id(model.get_input_embeddings()), id(model.get_output_embeddings())}
    for name in names:
        hits = [m for n, m in modules.items() if n and saved_matches(n, name)]
        if not hits:
            tops = sorted({n.rsplit(".", 1)[-1] for n, m in modules.items()
                           if n and len(m._parameters) and not n.rsplit(".", 1)[-1].isdigit()})
            raise ConfigError(f"lora.modules_to_save: no module of this model is named {name!r}; modules with "
                              f"parameters: {', '.join(tops)}")
        if tied and any(id(m) in embeddings for m in hits):
            raise ConfigError(f"lora.modules_to_save: {name!r} is a tied embedding (input and output share one "
                              "matrix) and training one copy would untie them; not supported yet: leave it out")
    return list(names)
