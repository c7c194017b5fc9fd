"""``toolkit train`` on tiny vision-language models (``docs/vlm.md``), as users run it: Qwen2.5-VL at ZeRO-3 (tower
frozen, eval on) resumed bit-exactly, its checkpoint converted to HF equal to ``hf_final/`` (and HF -> ZeRO -> HF
exact), ``toolkit inspect``
naming it; LLaVA with LoRA: ``adapter/`` loads with peft onto the base and gives ``hf_final/``'s logits, and
``hf_final/`` generates from an image with transformers alone (``AutoProcessor`` + ``AutoModelForImageTextToText``)."""
from __future__ import annotations

import json
import warnings

import pytest
import torch

from tests.helpers.runs import losses, resumes, run_in_process, train, train_args

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo suite")


def _base(model_dir, rows) -> list[str]:
    return [f"model.name_or_path={model_dir}", "model.init=pretrained", f"data.path={rows}", "data.format=json",
            "data.template=chat", "data.seq_len=160", "data.eval_fraction=0.1", "train.global_batch_size=4",
            "train.micro_batch_size=2", "train.lr=1e-3", "train.warmup_steps=1", "train.log_every=1",
            "train.eval_every=2", "checkpoint.every=2", "train.steps=4"]


@pytest.fixture(scope="module")
def qwen_runs(tiny_vlms, tmp_path_factory, data_cache):
    root, base = tmp_path_factory.mktemp("vlm_qwen"), _base(tiny_vlms["qwen2_5_vl"], tiny_vlms["rows"])
    train(root / "whole", data_cache, "zero.stage=3", base=base)
    train(root / "split", data_cache, "zero.stage=3", "train.steps=2", base=base)
    run_in_process(train_args(root / "split", data_cache, "zero.stage=3", base=base) + ["--resume", "auto"])
    return root


def test_resume_is_bitwise_exact_and_eval_runs(qwen_runs):
    whole, split = qwen_runs / "whole", qwen_runs / "split"
    assert resumes(split) and resumes(split)[0][1] == 2, resumes(split)
    assert losses(split) == losses(whole), (losses(split), losses(whole))
    evals = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines() if "eval_loss" in line]
    assert len(evals) == 2 and all(e["eval_loss"] > 0 for e in evals)


def test_zero3_to_hf_and_back_are_exact_and_inspect_says_what_it_is(qwen_runs, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    whole = qwen_runs / "whole"
    checkpoint = sorted((whole / "checkpoints").glob("step_*"))[-1]
    run_in_process(["convert", str(checkpoint), str(tmp_path / "hf")])
    ours, final = load_file(tmp_path / "hf" / "model.safetensors"), load_file(whole / "hf_final" / "model.safetensors")
    assert ours.keys() == final.keys() and all(torch.equal(ours[k], final[k]) for k in ours)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, info = AutoModelForImageTextToText.from_pretrained(whole / "hf_final", output_loading_info=True)
    assert not any(info.values()), info
    assert (whole / "hf_final" / "preprocessor_config.json").is_file()  # the processor's files beside the weights
    run_in_process(["convert", str(whole / "hf_final"), str(tmp_path / "zero"), "--to", "zero", "--dp", "2",
                    "--zero-stage", "3"])
    run_in_process(["convert", str(tmp_path / "zero"), str(tmp_path / "back")])  # HF -> ZeRO -> HF
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert back.keys() == final.keys() and all(torch.equal(back[k], final[k]) for k in back)
    shown = run_in_process(["inspect", str(checkpoint)]).stdout
    assert "vision-language model qwen2_5_vl" in shown and "projector model.visual.merger" in shown, shown


def test_lora_adapter_loads_with_peft_and_hf_final_generates(tiny_vlms, tmp_path, data_cache):
    from peft import PeftModel
    from PIL import Image
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText, AutoProcessor

    run = tmp_path / "lora"
    train(run, data_cache, "zero.stage=2", "lora.rank=4", "train.steps=3", "train.eval_every=0",
          base=_base(tiny_vlms["llava"], tiny_vlms["rows"]))
    row = json.loads(tiny_vlms["rows"].read_text().splitlines()[0])
    image = Image.open(tiny_vlms["rows"].parent / row["images"][0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        processor = AutoProcessor.from_pretrained(run / "hf_final")
        merged = AutoModelForImageTextToText.from_pretrained(run / "hf_final").eval()
        adapted = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(tiny_vlms["llava"]),
                                            run / "adapter").eval()
        prompt = processor.apply_chat_template(row["messages"][:1], add_generation_prompt=True)
        inputs = processor(text=[prompt], images=[image], return_tensors="pt")
        with torch.no_grad():
            gap = (merged(**inputs).logits - adapted(**inputs).logits).abs().max().item()
            out = merged.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert gap < 1e-5, gap
    # the converter reads the LoRA checkpoint: --to peft gives adapter/'s tensors; --to hf merges onto the base's
    # files (transformers' hub names, renamed by its own rules) and gives hf_final/'s
    checkpoint = sorted((run / "checkpoints").glob("step_*"))[-1]
    run_in_process(["convert", str(checkpoint), str(tmp_path / "peft"), "--to", "peft"])
    ours, exported = (load_file(d / "adapter_model.safetensors") for d in (tmp_path / "peft", run / "adapter"))
    assert ours.keys() == exported.keys() and all(torch.equal(ours[k], exported[k]) for k in ours)
    run_in_process(["convert", str(checkpoint), str(tmp_path / "merged"), "--to", "hf"])
    ours, exported = (load_file(d / "model.safetensors") for d in (tmp_path / "merged", run / "hf_final"))
    assert ours.keys() == exported.keys() and all(torch.equal(ours[k], exported[k]) for k in ours)
    targets = json.loads((run / "adapter" / "adapter_config.json").read_text())["target_modules"]
    assert not [t for t in targets if "vision_tower" in t], targets
    assert out.shape[1] > inputs["input_ids"].shape[1]
