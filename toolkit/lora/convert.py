"""``toolkit convert`` of LoRA adapters: a toolkit LoRA checkpoint (adapters only) or an HF-PEFT
directory, ``--to peft`` (an HF-PEFT directory in fp32) or ``--to hf`` (merged onto its base in fp32,
peft's ``merge_and_unload``), and ``--verify`` of either against peft itself.

Both sources become one ``Adapter``: peft's own model built on the meta device from the base's
config (no weight is made), with the trained tensors assigned to its adapter parameters. peft
decides everything a hand-written reader could get wrong: which saved key is which parameter
(``set_peft_model_state_dict``), each layer's scaling (``rank_pattern``, ``alpha_pattern``,
``use_rslora``), Conv1D's transposed layout, and the saved keys (``get_peft_model_state_dict``).
Adapters whose merge is not ``W + scaling x B @ A`` on a linear layer (DoRA, trained biases,
embedding or parameter LoRA, ...) are refused naming the reason; peft's ``merge_and_unload``
merges those.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from toolkit.formats.errors import ConvertError
from toolkit.formats.peft import PEFT_CONFIG, PEFT_WEIGHTS
from toolkit.lora.adapter import Adapter, assign_trained, check_mergeable
from toolkit.lora.checkpoint import meta_peft_model
from toolkit.lora.peft import ADAPTER, PEFT_PREFIX, lora_layers, merged_weight, peft_config
from toolkit.lora.spec import LoraSpec

ADAPTER_LOGIT_RTOL = 1e-5
"""``--verify``: max |logit difference| between peft's unmerged forward of SRC and DST, relative to
SRC's largest |logit|. The merge is exact in fp32 (the tensors are compared bit for bit); the
forwards differ by summation order only: measured <= 6e-7 x the largest logit on the tests' models."""



def adapter_from_checkpoint(ckpt: Path, meta: dict) -> Adapter:
    """A toolkit LoRA checkpoint's adapters, of either backend (``lora/checkpoint.py``'s ``read_lora_checkpoint``)."""
    from toolkit.lora.checkpoint import read_lora_checkpoint
    source = read_lora_checkpoint(ckpt, meta)
    model = meta_peft_model(source.hf_config, peft_config(LoraSpec(**meta["lora"])))
    assign_trained(model, source.trained(), f"{ckpt}")
    base = meta.get("base_model", {})
    return Adapter(model, source.hf_config, base.get("path") if base.get("init") == "pretrained" else None,
                   quantization=base.get("quantization"))


def adapter_from_peft_dir(path: Path, base: str | None, hf_config: dict | None = None) -> Adapter:
    """An HF-PEFT directory's adapter, on the base's config: ``hf_config``, else the config.json of
    ``base`` or of the adapter's own ``base_model_name_or_path`` (a local HF directory)."""
    from peft import PeftConfig
    from peft.utils import load_peft_weights
    config = PeftConfig.from_pretrained(str(path))
    config.inference_mode = False  # the adapter's tensors are what a conversion carries: mark them trainable
    check_mergeable(config, path)
    if hf_config is None:
        base = str(_base_dir(path, base or config.base_model_name_or_path, given=base is not None))
        hf_config = json.loads((Path(base) / "config.json").read_text())
    model = meta_peft_model(hf_config, config)
    saved = {k: v.float() for k, v in load_peft_weights(str(path), device="cpu").items()}
    _load_saved(model, saved, path)
    return Adapter(model, hf_config, base)


def peft_dir_as_checkpoint(path: Path, base: str | None):
    """An HF-PEFT directory as a LoRA checkpoint at step 0 without optimizer state (Adam starts
    fresh), for ``--to zero`` / ``--to megatron``: a run with the same ``lora.*`` settings resumes
    from it. Its ``lora`` spec is resolved as the plan resolves ``lora.*`` from adapter_config.json's
    r, lora_alpha, lora_dropout, target_modules and modules_to_save, and must make exactly the
    adapter's tensors; per-module ranks or alphas and rsLoRA have no ``lora.*`` setting: refused."""
    from toolkit.config import ConfigError, LoraConfig
    from toolkit.families.meta import meta_model
    from toolkit.formats.canonical import hf_config_object
    from toolkit.lora.checkpoint import LoraSource
    from toolkit.lora.spec import resolve_lora
    from toolkit.storage.meta import base_model_record
    adapter = adapter_from_peft_dir(path, base)
    config = adapter.model.peft_config[ADAPTER]
    patterns = [f for f in ("rank_pattern", "alpha_pattern", "use_rslora") if getattr(config, f, None)]
    if patterns or isinstance(config.target_modules, str):
        raise ConvertError(f"{path}: its {', '.join(patterns) or 'regex target_modules'} cannot be said in lora.* "
                           "settings, so no toolkit run could resume this adapter; convert it --to hf (merged) and "
                           "fine-tune that")
    settings = LoraConfig(rank=config.r, alpha=config.lora_alpha, dropout=config.lora_dropout,
                          target_modules=sorted(config.target_modules), modules_to_save=list(config.modules_to_save or []))
    try:  # on the model the plan resolves against (a tied embedding tied), so a run can resume the result
        spec = resolve_lora(settings, meta_model(hf_config_object(adapter.hf_config)))
    except ConfigError as exc:
        raise ConvertError(f"{path}: its adapter_config.json as a toolkit run's settings is refused ({exc}), so no "
                           "toolkit run could resume this adapter; convert it --to hf (merged) and fine-tune that") from None
    trained = adapter.trained()
    resolved = {n: tuple(p.shape) for n, p in meta_peft_model(adapter.hf_config, peft_config(spec)).named_parameters()
                if p.requires_grad}
    if resolved != {n: tuple(t.shape) for n, t in trained.items()}:
        raise ConvertError(f"{path}: lora.* settings from its adapter_config.json make other tensors than it holds "
                           f"({sorted(set(resolved) ^ set(trained))[:3]}); convert it --to hf instead")
    meta = {"format": "peft", "lora": spec.model_dump(mode="json"),
            "base_model": base_model_record(adapter.base, "pretrained", 0)}
    return LoraSource(Path(path), "peft", adapter.hf_config, {n: {"param": t} for n, t in trained.items()}, meta,
                      step=0, trainer_state={"step": 0})


def _load_saved(model: torch.nn.Module, saved: dict[str, torch.Tensor], path: Path) -> None:
    """An HF-PEFT state dict into the meta model: which saved key is which parameter is asked of
    peft's own saving (``get_peft_model_state_dict`` over a marker per parameter); every adapter
    parameter must come from the file and every tensor of the file must land somewhere."""
    from peft import get_peft_model_state_dict

    names = [n for n, p in model.named_parameters() if p.requires_grad]
    keyed = get_peft_model_state_dict(model, state_dict={n: torch.tensor([i]) for i, n in enumerate(names)},
                                      adapter_name=ADAPTER)
    param_of = {key: names[int(marker)] for key, marker in keyed.items()}
    missing, unexpected = sorted(set(param_of) - set(saved)), sorted(set(saved) - set(param_of))
    if missing or unexpected:
        raise ConvertError(f"{path / PEFT_WEIGHTS} does not fit its adapter_config.json on this base: missing "
                           f"{missing[:5]}, unexpected {unexpected[:5]}; is it the right base?")
    assign_trained(model, {param_of[k]: v for k, v in saved.items()}, str(path))


def _base_dir(adapter: Path, base: str | None, given: bool) -> Path:
    flag = "--base" if given else f"{adapter / PEFT_CONFIG}'s base_model_name_or_path"
    if not base:
        raise ConvertError(f"{adapter}: the adapter names no base model; pass --base DIR (the HF model it was "
                           "trained on)")
    path = Path(base)
    if not (path / "config.json").is_file():
        raise ConvertError(f"{flag} = {base!r} is not a local HF model directory (no config.json); pass --base DIR "
                           "(a save_pretrained directory of the model the adapter was trained on)")
    return path


# --- writing -----------------------------------------------------------------------------------

def save_peft(model: torch.nn.Module, trained: dict[str, torch.Tensor], out: Path, base_name: str | None) -> None:
    """``adapter_config.json`` + ``adapter_model.safetensors`` (fp32, peft's saved key names) of a
    peft-wrapped model whose trained tensors are ``trained`` (by parameter name), into ``out``."""
    import copy

    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    tensors = get_peft_model_state_dict(model, state_dict=trained, adapter_name=ADAPTER)
    config = copy.deepcopy(model.peft_config[ADAPTER])
    config.base_model_name_or_path = base_name
    config.save_pretrained(str(out))
    save_file({k: v.float().contiguous() for k, v in tensors.items()}, str(out / PEFT_WEIGHTS), metadata={"format": "pt"})


def _module_named(base):
    """A vision-language base's reader under module names (``families.meta.module_names``: transformers'
    renaming rules), so adapters named after modules find their weights; a checkpoint already so named is
    unchanged by them."""
    from toolkit.families.meta import module_names
    from toolkit.formats.canonical import Source, hf_config_object
    try:
        to_module = module_names(hf_config_object(base.hf_config), list(base.infos))
    except ValueError as exc:
        raise ConvertError(f"the vision-language base {base.path}: {exc}; merge with peft instead "
                           "(PeftModel.from_pretrained(base, adapter).merge_and_unload())") from None
    to_file = {m: n for n, m in to_module.items()}

    class ModuleNamed(Source):
        collective = False

        def read(self, name: str, state: str = "param"):
            return base.read(to_file[name], state)

    return ModuleNamed(path=base.path, format=base.format, hf_config=base.hf_config,
                       infos={to_module[n]: i for n, i in base.infos.items()}, carry_files=list(base.carry_files))


def merged_source(base, model: torch.nn.Module, trained: dict[str, torch.Tensor]):
    """The base's HF reader with each adapted weight merged, W + scaling x B @ A in fp32 with each
    layer's own scaling, and each module to save replaced by its trained copy; every tensor fp32.
    ``model``: a peft-wrapped model (its layers give names and scalings), ``trained``: its trained
    tensors by parameter name. Read whole, one at a time by rank 0 alone (``collective`` False)."""
    from toolkit.formats.canonical import Source, TensorInfo
    pairs, saved = merge_table(model, trained)

    class Merged(Source):
        collective = False

        def read(self, name: str, state: str = "param"):
            if name in saved:
                return saved[name].float()
            tensor = base.read(name, state)
            if name not in pairs:
                return tensor.float()
            return merged_weight(tensor, *pairs[name])

    if isinstance(base.hf_config.get("vision_config"), dict):  # hub names, the adapters' are module names
        base = _module_named(base)
    absent = sorted(set(pairs) - set(base.infos)) + sorted(set(saved) - set(base.infos))
    if absent:
        raise ConvertError(f"the base checkpoint {base.path} lacks the adapted tensors {absent[:5]}")
    wrong = [f"{n}: base {tuple(base.infos[n].shape)}, adapter {tuple(_delta_shape(*pairs[n]))}" for n in pairs
             if tuple(base.infos[n].shape) != tuple(_delta_shape(*pairs[n]))]
    if wrong:
        raise ConvertError(f"the adapter does not fit the base {base.path}: {'; '.join(wrong[:3])}")
    return Merged(path=base.path, format="hf-merged", hf_config={**base.hf_config, "dtype": "float32"},
                  infos={n: TensorInfo(tuple(i.shape), torch.float32) for n, i in base.infos.items()},
                  carry_files=list(base.carry_files))


def merge_table(model: torch.nn.Module, trained: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """({HF weight name: (lora_A, lora_B, scaling, fan_in_fan_out)}, {HF name: trained copy}): the
    tensors from ``trained`` (by peft parameter name), each layer's scaling and layout from peft's
    own layers of ``model`` (so rank/alpha patterns and rsLoRA scale as peft scales them)."""
    pairs = {f"{name.removeprefix(PEFT_PREFIX)}.weight": (trained[f"{name}.lora_A.{ADAPTER}.weight"],
                                                          trained[f"{name}.lora_B.{ADAPTER}.weight"],
                                                          m.scaling[ADAPTER], m.fan_in_fan_out)
             for name, m in lora_layers(model)}
    saved = {n.removeprefix(PEFT_PREFIX).replace(f".modules_to_save.{ADAPTER}.", "."): t
             for n, t in trained.items() if f".modules_to_save.{ADAPTER}." in n}
    return pairs, saved


def _delta_shape(a: torch.Tensor, b: torch.Tensor, scaling: float, fan_in_fan_out: bool) -> tuple[int, int]:
    return (a.shape[1], b.shape[0]) if fan_in_fan_out else (b.shape[0], a.shape[1])


# --- convert -----------------------------------------------------------------------------------

def convert_adapter(adapter: Adapter, src: Path, dst: Path, to: str, max_shard_bytes: int, step=None,
                    base_given: bool = False) -> dict:
    """``adapter`` written staged as an HF-PEFT directory (``--to peft``) or merged onto its base
    (``--to hf``, fp32). Adapters trained on a 4-bit base merge only onto a base named by ``--base``
    (``base_given``), and the summary's ``notes`` say how far the merged logits move from the trained
    function's (``quantized_merge_movement``)."""
    from toolkit.formats.hf import HFSource, write_hf
    from toolkit.formats.staging import staged
    if to not in ("hf", "peft"):
        raise ConvertError(f"{src}: a LoRA adapter converts --to peft (the adapter) or --to hf (merged onto its "
                           f"base), not --to {to}")
    if to == "hf" and adapter.base is None and adapter.base_source is None:
        raise ConvertError(f"{src}: the LoRA base was a random init (seed); --to hf needs a pretrained base: use the "
                           "run's hf_final/, or --to peft")
    q = adapter.quantization
    if to == "hf" and q and not base_given:  # merged onto the full-precision files: not what trained
        raise ConvertError(f"{src}: the adapters trained on a {q['quant_type']}-quantized base (model.quantize="
                           f"{q['quant_type']}); merged onto its full-precision weights they give another function. "
                           "Pass --base PATH (an HF base to merge onto: the printed logit movement says how far it "
                           "is from what trained), or use the run's hf_final/ (the base dequantized + the merged "
                           "adapters), or --to peft and load the adapter on the base quantized by transformers "
                           "(docs/lora.md)")
    trained = adapter.trained()
    notes = []
    with staged(Path(dst)) as stage:
        if to == "peft":
            save_peft(adapter.model, trained, stage, adapter.base)
        else:
            base = adapter.base_source or HFSource(Path(adapter.base))
            try:
                write_hf(merged_source(base, adapter.model, trained), stage, max_shard_bytes=max_shard_bytes)
                if q:
                    notes.append(quantized_merge_movement(stage, base, adapter.model, trained, q).line())
            finally:
                base.close()
    return {"src": str(src), "dst": str(dst), "from": "LoRA adapter", "to": to,
            "family": adapter.hf_config.get("model_type"), "tensors": len(trained), "step": step,
            "optimizer_state": False, "reader": "torch", "seconds": 0.0, "notes": notes}


PROBE_SHAPE = (4, 32)
"""The probe batch of a QLoRA merge's logit movement: rows x tokens, ``probe_ids``."""


def probe_ids(vocab_size: int) -> torch.Tensor:
    """The fixed probe batch: token ids drawn uniformly with seed 0."""
    return torch.randint(0, vocab_size, PROBE_SHAPE, generator=torch.Generator().manual_seed(0))


@dataclass
class Movement:
    """How far the logits of a merge onto a full-precision base (``merged``) are from the trained
    function's (the base quantized as the run did, dequantized, + the merged adapters: ``hf_final/``)."""
    max_rel: float
    """max |merged - trained| / max |trained|."""
    mean_rel: float
    """mean |merged - trained| / mean |trained|."""
    quant_type: str
    layers: int

    def line(self) -> str:
        return (f"logit movement vs the trained function ({self.quant_type} base dequantized + adapters, as hf_final/ "
                f"holds it; {self.layers} quantized layers) on a fixed probe batch ({PROBE_SHAPE[0]}x{PROBE_SHAPE[1]} "
                f"tokens, seed 0): max |diff|/max |logit| {self.max_rel:.3e}, mean |diff|/mean |logit| "
                f"{self.mean_rel:.3e}")


def quantized_merge_movement(merged_dir: Path, base, model: torch.nn.Module, trained: dict[str, torch.Tensor],
                             quantization: dict) -> Movement:
    """The written merge (``merged_dir``) against the trained function on ``probe_ids``. One model in
    memory: the merge's logits first, then each quantized layer's weight swapped for the round trip
    of the base's (``quant.round_trip``) + its adapter, every other tensor rounded to the run's dtype (as
    the run held it), then the trained function's logits."""
    from transformers import AutoModelForCausalLM

    from toolkit.engine import DTYPES
    from toolkit.lora.quant import quantized_modules, round_trip
    net = AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=torch.float32, trust_remote_code=False).eval()
    ids = probe_ids(net.config.vocab_size)
    pairs, _ = merge_table(model, trained)
    layers = quantized_modules(net)
    with torch.no_grad():
        merged = net(input_ids=ids).logits
        for layer in layers:
            name = f"{layer}.weight"
            whole = round_trip(base.read(name), quantization)
            weight = merged_weight(whole, *pairs[name]) if name in pairs else whole.float()
            net.get_submodule(layer).weight.copy_(weight)
        swapped = {f"{layer}.weight" for layer in layers}
        for name, param in net.named_parameters():
            if name not in swapped:
                param.copy_(param.to(DTYPES[quantization["storage_dtype"]]).float())
        want = net(input_ids=ids).logits
    gap = (merged - want).abs()
    return Movement(float(gap.max() / want.abs().max()), float(gap.mean() / want.abs().mean()),
                    quantization["quant_type"], len(layers))


def open_adapter(src, base: str | None, hf_config: str | None = None) -> tuple[Adapter, dict]:
    """(the adapter, a description) of a LoRA source, a path or where ``formats.detect.locate`` found
    one: an HF-PEFT directory, a DCP of a peft model (``lora/dcp.py``; ``hf_config``: its base's
    config.json, else the one beside it) or a toolkit LoRA checkpoint (run directory or checkpoint),
    its base checked against meta.json's fingerprint. The format table says which (``lora_adapter``)."""
    from toolkit.formats.detect import Located, locate
    from toolkit.formats.table import by_name
    found = src if isinstance(src, Located) else locate(src, hf_config)
    fmt = by_name(found.format)
    if not fmt.adapters:
        raise ConvertError(f"{found.path}: {found.format}, not LoRA adapters (an HF-PEFT directory, a DCP of a "
                           "peft model or a toolkit LoRA checkpoint)")
    return fmt.open_adapter(found, base, hf_config)


def adapter_of_checkpoint(found, base: str | None, hf_config: str | None = None) -> tuple[Adapter, dict]:
    """The table's ``lora_adapter`` of a toolkit LoRA checkpoint of either backend."""
    from toolkit.storage.meta import read_meta
    ckpt, meta = found.path, read_meta(found.path)
    adapter = adapter_from_checkpoint(ckpt, meta)
    if base is not None:
        adapter.base = base
    if adapter.base is not None:
        _check_fingerprint(ckpt, meta, adapter.base)
    return adapter, {"format": f"{meta['format']} (LoRA)", "step": meta.get("step")}


def adapter_of_peft_dir(found, base: str | None, hf_config: str | None = None) -> tuple[Adapter, dict]:
    """The table's ``lora_adapter`` of an HF-PEFT directory."""
    return adapter_from_peft_dir(found.path, base), {"format": "peft"}


def peft_located_as_checkpoint(found, base: str | None):
    """The table's ``lora_checkpoint`` of an HF-PEFT directory (``peft_dir_as_checkpoint``)."""
    return peft_dir_as_checkpoint(found.path, base)


def _check_fingerprint(ckpt: Path, meta: dict, base: str) -> None:
    from toolkit.storage.meta import base_model_record
    want = meta.get("base_model", {}).get("fingerprint")
    now = base_model_record(base, "pretrained", 0)["fingerprint"]
    if want != now:
        raise ConvertError(f"{ckpt}: the base {base} has fingerprint {now}, the adapters were trained on {want} "
                           f"({meta.get('base_model', {}).get('path')}); merging onto another base would be wrong")


# --- verify ------------------------------------------------------------------------------------

@torch.no_grad()
def verify_lora(found, dst: Path, base: str | None, to: str | None):
    """``--verify`` of a LoRA source's conversion (``found``: where ``formats.detect.locate`` found it):
    another backend's LoRA checkpoint holds the same adapters and moments, an adapter directory or a
    merged model what peft makes of the source (``verify_adapter``)."""
    from toolkit.formats.table import backend_targets, by_name
    from toolkit.lora.checkpoint import compare_lora_sources, open_lora_checkpoint
    if to in backend_targets():
        return compare_lora_sources(by_name(found.format).open_lora_checkpoint(found, base), open_lora_checkpoint(dst))
    return verify_adapter(found, dst, base)


@torch.no_grad()
def verify_adapter(src, dst: Path, base: str | None):
    """DST against SRC (a path, or where ``formats.detect.locate`` found it) through peft: an HF-PEFT DST's tensors
    equal SRC's adapter; a merged DST's tensors equal peft's ``merge_and_unload()`` of SRC on its base, bit
    for bit; and DST's logits on a fixed batch equal peft's unmerged forward of SRC (``ADAPTER_LOGIT_RTOL``);
    a tensor DST holds beyond those is a mismatch. Without a pretrained base (a random-init run) only the
    adapter tensors are compared."""
    from toolkit.formats.peft import find_peft_dir
    from toolkit.formats.report import Report
    adapter, _ = open_adapter(src, base)
    report = Report()
    want = adapter.trained()
    if find_peft_dir(dst) is not None:
        try:  # a tensor the adapter_config.json does not make, or one missing, is refused by name
            got = adapter_from_peft_dir(dst, adapter.base, adapter.hf_config).trained()
        except ConvertError as exc:
            report.mismatched.append(f"DST does not load: {exc}")
            return report
        report.mismatched += [n for n in want if n not in got or not torch.equal(want[n], got[n])]
        report.tensors = len(want)
    if adapter.base is None:
        return report
    reference = _peft_model(adapter)
    ids = torch.randint(0, adapter.hf_config["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    expected = reference(input_ids=ids).logits
    if find_peft_dir(dst) is not None:
        from peft import PeftModel
        target = PeftModel.from_pretrained(_base_model(adapter.base), str(dst)).eval()
    else:
        from transformers import AutoModelForCausalLM
        target = AutoModelForCausalLM.from_pretrained(str(dst), dtype=torch.float32, trust_remote_code=False).eval()
        merged, stored = reference.merge_and_unload().state_dict(), target.state_dict()
        report.mismatched += [n for n in merged if n not in stored or not torch.equal(merged[n], stored[n])]
        # transformers skips a file's tensors that its model has no place for: read the names from the files
        report.mismatched += [f"{n} (only in DST)" for n in sorted(_stored_names(dst) - set(merged))]
        report.tensors = len(merged)
    report.logits_max_diff = float((target(input_ids=ids).logits - expected).abs().max())
    report.logits_tol = ADAPTER_LOGIT_RTOL * float(expected.abs().max())
    return report


def _stored_names(path: Path) -> set[str]:
    """Every tensor name in an HF directory's safetensors files."""
    from safetensors import safe_open
    names: set[str] = set()
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            names |= set(f.keys())
    return names


def _base_model(path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, trust_remote_code=False).eval()


def _peft_model(adapter: Adapter) -> torch.nn.Module:
    """peft's model of the base with the adapter's tensors: the reference for ``--verify``."""
    from peft import get_peft_model

    model = get_peft_model(_base_model(adapter.base), adapter.model.peft_config[ADAPTER])
    trained = adapter.trained()
    missing = set(trained) - {n for n, p in model.named_parameters() if p.requires_grad}
    if missing:
        raise ConvertError(f"peft's model of {adapter.base} has no {sorted(missing)[:5]}")
    for name, tensor in trained.items():
        model.get_parameter(name).copy_(tensor)
    return model.eval()

