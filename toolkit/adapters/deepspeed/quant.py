"""The 4-bit base of a QLoRA run on DeepSpeed (``model.quantize``, ``toolkit/lora/quant.py``), built one piece at
a time so that no rank ever holds the base in full precision, and the guards bitsandbytes needs.

The model skeleton is ``hf.empty_model``'s (meta parameters) with transformers' own
``replace_with_bnb_linear`` swapping the layers ``quant.quantized_modules`` names for bitsandbytes'
``Linear4bit``. Each piece (``hf.init_units``: a decoder layer, the embedding, the norm, the head) is then
read (the checkpoint by name, or ``hf.SeededWeights``' seeded init), each tensor cast to the model dtype
and only then quantized, as transformers does (quantizing the fp32 tensor of a bf16 run gives other
bits), with the storage dtype = the model dtype (DeepSpeed value-casts a parameter of another float
dtype: packed bytes would be corrupted). At ZeRO-3 each finished piece is partitioned at once
(``zero.Init(module=piece)``: the packed storage is an ordinary tensor to DeepSpeed, its quant state
stays on the parameter). Quantization is deterministic, so every rank and every resume builds the same
bits. A rank's peak: the 4-bit pieces built so far (its partitions at ZeRO-3) + one piece whole.

peft's ``prepare_model_for_kbit_training`` is not called: DeepSpeed casts its fp32 norms back to the
model dtype at ZeRO 0-2 (as HF Trainer + DeepSpeed trains QLoRA), and on a partitioned model it would
leave parameters whose ``.dtype`` is not their storage's. What it does that matters here (a frozen base,
non-reentrant activation checkpointing) ``lora/peft.py`` and ``hf.finish`` do.

Guards: bitsandbytes' CPU forward repacks a weight in place for AVX512-BF16 kernels in eval under no_grad
(a crash on small layers, and a permanent numerics change otherwise): turned off on every layer. The
quant state (absmax, code tables) is kept out of state dicts, so a checkpoint holds the adapters only,
as a LoRA one does. Packed storage holds NaN bit patterns: sums over it go through an integer view.
"""
from __future__ import annotations

import logging
import re

import torch
import torch.distributed as dist

from toolkit.plan import Plan

QUANT_STATE_KEY = re.compile(r"\.weight\.(absmax|quant_map|nested_absmax|nested_quant_map|quant_state\..*)$")
"""State-dict keys ``Linear4bit`` adds beside its packed weight (the quant state: rebuilt at load)."""


def import_bnb():
    """bitsandbytes, or the install line; without the log line its CPU backend writes at import when the
    optional ``kernels`` package (hub kernels) is absent: its default op runs instead."""
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    try:
        import bitsandbytes
    except ImportError:
        raise RuntimeError("model.quantize needs bitsandbytes: pip install -c requirements/constraints.txt "
                           "-e '.[quant]'") from None
    return bitsandbytes


def build_quantized(plan: Plan, ds_config: dict, dtype: torch.dtype, device: torch.device,
                    attention=None) -> torch.nn.Module:
    """The HF model with its 4-bit base, built piece by piece; partitioned piece by piece at ZeRO-3.
    ``attention``: what ``hf.finish`` installs for the run's sequence split (Ulysses under zero.sp)."""
    bnb = import_bnb()  # first: transformers' bitsandbytes integration imports it too
    from transformers.integrations import replace_with_bnb_linear

    from toolkit.adapters import hf
    from toolkit.lora import quant
    cfg = plan.config
    model = hf.empty_model(plan.model.hf_config())
    replace_with_bnb_linear(model, modules_to_not_convert=quant.kept_modules(model),
                            quantization_config=quant.bnb_config(cfg))
    stage3 = plan.layout(dist.get_world_size()).zero_stage == 3
    if stage3:
        import deepspeed

        from toolkit.parallel import comm_backend
        deepspeed.init_distributed(dist_backend=comm_backend())
    reader = _Reader(plan, model)
    owners = _owners(model)
    with torch.no_grad():
        for unit in reader.units:
            tensors = reader.tensors(unit)
            for name, value in tensors.items():
                _place(model, owners, name, value.to(dtype), dtype, device, bnb)
            reader.done()
            if stage3:
                import deepspeed
                deepspeed.zero.Init(module=model.get_submodule(unit), config_dict_or_path=ds_config)
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
    model.register_state_dict_post_hook(_drop_quant_state)
    model.is_loaded_in_4bit = True  # what transformers marks (peft reads it: its 4-bit LoRA layers)
    return hf.finish(model, plan, attention)


class _Reader:
    """The base's tensors a piece at a time, by parameter name, as ``hf`` reads them for an unquantized
    model: from the checkpoint (``model.init=pretrained``) or ``SeededWeights``' seeded init (whose
    pieces and owners, on a meta model, also say which piece reads which checkpoint tensor)."""

    def __init__(self, plan: Plan, model: torch.nn.Module):
        from toolkit.adapters import hf
        self.seeded = hf.SeededWeights(model.config, plan.config.train.seed)
        self.units, self.source = self.seeded.units, None
        if plan.config.model.init == "pretrained":
            self.source = hf.hf_checkpoint(plan)
            self.pieces, self.give_back = hf.checkpoint_pieces(model, plan, self.source), hf.page_returner(self.source)
            self.shapes = {n: p.shape for n, p in model.named_parameters()}

    def tensors(self, unit: str) -> dict[str, torch.Tensor]:
        if self.source is None:
            return self.seeded.unit_tensors(unit)
        from toolkit.adapters.hf import read_elements
        return {name: read_elements(self.source, self.pieces[name], 0, self.shapes[name].numel()).view(self.shapes[name])
                for name in self.seeded.owned(unit)}

    def done(self) -> None:
        """After each piece: its full-precision tensors are freed; their pages go back to the OS (between
        the packed tensors kept, glibc's heap would hold them: measured ~1 GB at 375M parameters)."""
        if self.source is not None:
            self.give_back()  # the checkpoint's pages and the heap's free pages
        else:
            from toolkit.heap import trim_heap
            trim_heap()


def _owners(model: torch.nn.Module) -> dict[int, list[tuple[torch.nn.Module, str]]]:
    """Each parameter (by id) and the modules holding it: a tied one is replaced in all of them."""
    out: dict[int, list] = {}
    for module in model.modules():
        for attr, param in module._parameters.items():
            if param is not None:
                out.setdefault(id(param), []).append((module, attr))
    return out


def _place(model, owners, name: str, value: torch.Tensor, dtype, device, bnb) -> None:
    """Parameter ``name`` made from ``value`` (already in the model dtype): a ``Linear4bit`` weight
    quantized on ``device`` (``Params4bit.to`` quantizes), any other one as it is."""
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    old = module._parameters[attr]
    if isinstance(module, bnb.nn.Linear4bit) and attr == "weight":
        new = bnb.nn.Params4bit(value, requires_grad=False, compress_statistics=old.compress_statistics,
                                quant_type=old.quant_type, quant_storage=dtype, module=module).to(device)
    else:
        new = torch.nn.Parameter(value.to(device), requires_grad=old.requires_grad)
    for holder, holder_attr in owners[id(old)]:
        holder._parameters[holder_attr] = new


def _drop_quant_state(module, state_dict, prefix, local_metadata) -> None:
    for key in [k for k in state_dict if k.startswith(prefix) and QUANT_STATE_KEY.search(k)]:
        del state_dict[key]
