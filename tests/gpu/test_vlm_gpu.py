"""Vision-language models on the device (``pytest -m gpu``; docs/vlm.md): the toolkit's model (tower frozen, document
attention on the language model only: flex_attention with a block mask on the GPU, which the CPU suite cannot run;
per-document M-RoPE computed on the device) on a micro-batch of rows packed by documents, pixels made by the data
pipeline, against each document alone through HF's own model (sdpa, its own positions): logits, and the packed
batch's gradients against the documents' summed alone. fp32 with TF32 off. ``TOOLKIT_GPU_TESTS_ON_CPU=1``
rehearses it on the CPU."""
from __future__ import annotations

import warnings

import pytest
import torch

from tests.helpers.gpu import DEVICE, GPU_ONLY
from tests.helpers.measure import measure
from toolkit.loss import IGNORE_INDEX

pytestmark = [*GPU_ONLY, pytest.mark.usefixtures("strict_fp32")]
TOL = 1e-4


def _micro_batch(model_dir, rows, tmp_path):
    from toolkit.config import validate
    from toolkit.data import prepare_data, rank_micro_batches
    cfg = validate({"backend": "deepspeed", "model": {"name_or_path": str(model_dir), "init": "pretrained"},
                    "data": {"path": str(rows), "format": "json", "template": "chat", "seq_len": 160,
                             "eval_fraction": 0.0, "cache_dir": str(tmp_path / "cache")},
                    "train": {"global_batch_size": 2, "micro_batch_size": 2}})
    data = prepare_data(cfg, None)
    return cfg, data, rank_micro_batches(data.train, [0, 1], 0, 1, 2, data.images)[0]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava"])
def test_packed_image_documents_equal_hf_alone_on_the_device(family, tiny_vlms, tmp_path):
    from transformers import AutoModelForImageTextToText

    from toolkit.adapters import hf, hf_attention, vlm
    from toolkit.plan import build_plan
    warnings.filterwarnings("ignore")
    cfg, data, mb = _micro_batch(tiny_vlms[family], tiny_vlms["rows"], tmp_path)
    model = hf.build_model(build_plan(cfg, [1]), torch.float32, DEVICE)
    mb = {k: v.to(DEVICE) for k, v in mb.items()}
    inputs = vlm.forward_inputs(mb, model)
    logits = model(**inputs).logits
    hf_attention.check_applied(inputs)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), mb["labels"].flatten(), ignore_index=IGNORE_INDEX,
                                             reduction="sum")
    loss.backward()
    ref = AutoModelForImageTextToText.from_pretrained(tiny_vlms[family], dtype=torch.float32).to(DEVICE)
    for name, p in ref.named_parameters():
        p.requires_grad_(dict(model.named_parameters())[name].requires_grad)
    worst, ref_loss = 0.0, 0.0
    image_id = data.images.image_id
    grids = mb.get("image_grid_thw")
    per_image = (grids.prod(1) // model.config.vision_config.spatial_merge_size ** 2).tolist() if grids is not None \
        else None
    taken = 0
    for r in range(mb["input_ids"].shape[0]):
        docs = mb["document_ids"][r]
        for d in range(1, int(docs.max()) + 1):
            ids, labels = mb["input_ids"][r][docs == d], mb["labels"][r][docs == d]
            n_images = int((ids == image_id).sum())
            first = taken
            if per_image is not None:  # Qwen2.5-VL: patches of this document's images, in order
                while n_images > 0:
                    n_images -= per_image[taken]
                    taken += 1
                starts = [0] + torch.cumsum(grids.prod(1), 0).tolist()
                doc_inputs = {"pixel_values": mb["pixel_values"][starts[first]:starts[taken]],
                              "image_grid_thw": grids[first:taken], "mm_token_type_ids": (ids == image_id).int()[None]}
            else:  # LLaVA ("default" strategy): (image_size / patch_size)^2 tokens per image
                vision = model.config.vision_config
                count = n_images // (vision.image_size // vision.patch_size) ** 2
                doc_inputs = {"pixel_values": mb["pixel_values"][taken:taken + count]}
                taken += count
            alone = ref(input_ids=ids[None], **doc_inputs).logits[0]
            worst = max(worst, (logits[r][docs == d] - alone).abs().max().item())
            ref_loss = ref_loss + torch.nn.functional.cross_entropy(alone, labels, ignore_index=IGNORE_INDEX,
                                                                    reduction="sum")
    ref_loss.backward()
    ref_grads = dict(ref.named_parameters())
    gap = max(((p.grad - ref_grads[n].grad).norm() / ref_grads[n].grad.norm().clamp(min=1e-12)).item()
              for n, p in model.named_parameters() if p.requires_grad)
    measure(f"{family} on {DEVICE}: logits packed vs HF alone, max abs", worst, TOL)
    measure(f"{family} on {DEVICE}: grads packed vs HF alone, max rel", gap, TOL)
    assert worst < TOL and gap < TOL, (worst, gap)
