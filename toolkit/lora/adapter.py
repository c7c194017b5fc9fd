"""A LoRA adapter as the converter holds it (``Adapter``), filled and checked: the trained tensors into
peft's meta model, and the refusal of adapters whose merge is not ``W + scaling x B @ A``. Shared by
the converter (``lora/convert.py``) and the peft-in-DCP reader (``lora/dcp.py``)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from toolkit.formats.errors import ConvertError

UNMERGEABLE = {
    "use_dora": "DoRA rescales each merged column by a trained magnitude",
    "lora_bias": "it trains a bias for the adapted layers",
    "target_parameters": "it adapts raw parameters (target_parameters), not linear layers",
    "trainable_token_indices": "it trains embedding rows (trainable_token_indices)",
    "alora_invocation_tokens": "activated LoRA applies only after its invocation tokens",
    "layer_replication": "it replicates layers of the base",
    "use_qalora": "QA-LoRA pools the inputs of quantized layers",
    "use_bdlora": "its adapters are block-diagonal",
}
"""adapter_config.json fields (when set) that make an adapter something other than W + s x B @ A."""


@dataclass
class Adapter:
    """A LoRA adapter as the converter holds it: peft's model of the base on the meta device with the
    trained tensors (fp32) in its adapter parameters (and modules to save), and the base's path."""
    model: torch.nn.Module
    hf_config: dict
    base: str | None
    base_source: object = None
    """The base's weights as a ``Source`` where the adapter's checkpoint holds them (a peft model's
    DCP: ``lora/dcp.py``); else ``base`` (an HF directory) is read for a merge."""
    quantization: dict | None = None
    """meta.json's record of a 4-bit base the adapters trained on (``model.quantize``), else None."""

    def trained(self) -> dict[str, torch.Tensor]:
        """The trained tensors by peft parameter name (``base_model.model.<hf>.lora_A.default.weight``)."""
        return {n: p.detach() for n, p in self.model.named_parameters() if p.requires_grad}


# --- reading -----------------------------------------------------------------------------------


def assign_trained(model: torch.nn.Module, tensors: dict[str, torch.Tensor], where: str) -> None:
    """The trained tensors into the meta model's trainable parameters, by name, all of them."""
    expected = {n for n, p in model.named_parameters() if p.requires_grad}
    if expected != set(tensors):
        raise ConvertError(f"{where}: the trained tensors are not this LoRA spec's: missing "
                           f"{sorted(expected - set(tensors))[:5]}, unexpected {sorted(set(tensors) - expected)[:5]}")
    params = dict(model.named_parameters())
    wrong = [f"{n} {tuple(t.shape)} (this base needs {tuple(params[n].shape)})" for n, t in tensors.items()
             if t.shape != params[n].shape]
    if wrong:
        raise ConvertError(f"{where}: the adapter does not fit this base: {'; '.join(wrong[:3])}; is it the right base?")
    model.load_state_dict(tensors, strict=False, assign=True)


def check_mergeable(config, path: Path) -> None:
    if str(getattr(config, "peft_type", "")) not in ("LORA", "PeftType.LORA"):
        raise ConvertError(f"{path}: a {config.peft_type} adapter; toolkit convert reads LoRA adapters only")
    reasons = [f"{field} ({why})" for field, why in UNMERGEABLE.items() if getattr(config, field, None)]
    if getattr(config, "bias", "none") != "none":
        reasons.append(f"bias={config.bias!r} (it trains biases of the base)")
    if reasons:
        raise ConvertError(f"{path}: this adapter is not a plain LoRA (W + scaling x B @ A): {'; '.join(reasons)}. "
                           "Merge it with peft's merge_and_unload()")
