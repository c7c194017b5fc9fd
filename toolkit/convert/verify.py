"""``--verify``: the destination holds the source's tensors exactly (in the destination's dtype), and
an HF forward of a fixed batch from each gives the same logits (within that dtype's rounding)."""
from __future__ import annotations

import torch

from toolkit.formats.canonical import Source, hf_config_object
from toolkit.formats.detect import open_source
from toolkit.formats.errors import ConvertError
from toolkit.formats.report import Report

LOGIT_RTOL = {torch.float32: 0.0, torch.bfloat16: 5e-2, torch.float16: 2e-2}
"""Max |logit difference| between SRC's forward at its own precision and DST's as stored, relative
to SRC's largest |logit|, per destination dtype. fp32 weights are bit-identical, so the forward is
too. Half types round each weight (2^-8 / 2^-11 relative); measured on the tests' tiny models: bf16
up to 9.1e-3, fp16 6.3e-4 (dense) and 5.2e-3 (MoE: rounding flips near-tied routing choices)."""


def verify(src, dst, hf_config: str | None = None, logits: bool = True) -> Report:
    a, b = open_source(src, hf_config), open_source(dst)
    try:
        report = compare_tensors(a, b)
        if logits:
            _check_transformers_knows(a, report)
            dtype = next(iter(b.infos.values())).dtype
            report.logits_max_diff, scale = _logits_diff(a, b)
            report.logits_tol = LOGIT_RTOL.get(dtype, 5e-2) * scale
        return report
    finally:
        a.close()
        b.close()


def compare_tensors(a: Source, b: Source) -> Report:
    report = Report()
    missing = sorted(set(a.names()) ^ set(b.names()))
    report.mismatched += [f"{n} (only in one)" for n in missing]
    moments = a.has_optimizer and b.has_optimizer
    for name in a.names():
        if name in missing:
            continue
        want = a.read(name)
        got = b.read(name)
        if not torch.equal(want.to(b.infos[name].dtype).float(), got.float()):
            report.mismatched.append(name)
        report.tensors += 1
        if moments:
            for state in ("exp_avg", "exp_avg_sq"):
                if not torch.equal(a.read(name, state), b.read(name, state)):
                    report.mismatched.append(f"{name}.{state}")
                report.moments += 1
    return report


def _check_transformers_knows(source: Source, report: Report) -> None:
    """The logits check builds each side as a transformers model: refuse a model_type it lacks, after
    the tensors were compared (their result is in the message)."""
    from transformers import CONFIG_MAPPING, __version__
    model_type = source.hf_config.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise ConvertError(f"{source.path}: --verify compares logits through transformers, which has no model_type "
                           f"{model_type!r} (transformers {__version__}); the conversion itself is done, and "
                           f"{report.lines()[0]}. To compare logits too, give --hf-config a config.json whose "
                           "model_type transformers knows")


def _model(source: Source, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_config(hf_config_object(source.hf_config), dtype=torch.float32,
                                             trust_remote_code=False)
    state = {n: source.read(n).to(dtype).float() for n in source.names()}
    from toolkit.families import find_family, pack
    state = pack(find_family(source.model_type), model.config, state)  # MoE: experts into their module
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and source.tied)]
    if missing or unexpected:
        raise RuntimeError(f"{source.path}: the HF model does not take these tensors; missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    if source.tied:
        model.tie_weights()
    return model.eval()


@torch.no_grad()
def _logits_diff(a: Source, b: Source) -> tuple[float, float]:
    """(max |logit difference|, max |SRC logit|) on a fixed batch: SRC's weights as they are, DST's
    as it stores them, each model built from its own config.json. A half-precision DST is judged by
    what its rounding does to the output, not by comparing the rounded weights a second time."""
    vocab = a.hf_config["vocab_size"]
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    la = _model(a, torch.float32)(input_ids=ids).logits
    lb = _model(b, torch.float32)(input_ids=ids).logits
    return float((la - lb).abs().max()), float(la.abs().max())
