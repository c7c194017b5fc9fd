"""A vision-language model's processor without its video processor.

transformers 5.24's Qwen2.5-VL processor takes a video processor that needs torchvision; without
torchvision (this environment: PyPI's torchvision for torch 2.13 is a CUDA build that fails to import
against the CPU torch) ``AutoProcessor.from_pretrained`` raises ``ImportError`` naming it. The toolkit
trains on images only, so it builds the model's own processor class with ``video_processor=None``,
skipping only that argument's class check; its ``__call__``, ``apply_chat_template`` and image-token
counting are the class's own. Used only when ``AutoProcessor`` fails that way (``data/vision.py``).
"""
from __future__ import annotations


def needs_torchvision(exc: BaseException) -> bool:
    """Whether ``AutoProcessor`` failed on the video processor's torchvision requirement."""
    return isinstance(exc, ImportError) and "torchvision" in str(exc).lower()


def image_only_processor(path: str):
    """The processor class ``path``'s ``processor_config.json``/config names, built without a video processor."""
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer
    from transformers.models.auto.processing_auto import processor_class_from_name
    from transformers.processing_utils import ProcessorMixin
    cls = _processor_class(path, AutoConfig.from_pretrained(path, trust_remote_code=False),
                           processor_class_from_name)
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    images = AutoImageProcessor.from_pretrained(path, trust_remote_code=False)
    check = ProcessorMixin.check_argument_for_proper_class

    def skip_missing_video(self, name, arg):
        return None if name == "video_processor" and arg is None else check(self, name, arg)
    ProcessorMixin.check_argument_for_proper_class = skip_missing_video
    try:
        return cls(image_processor=images, tokenizer=tok, video_processor=None, chat_template=tok.chat_template)
    finally:
        ProcessorMixin.check_argument_for_proper_class = check


def _processor_class(path: str, config, by_name):
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES
    name = PROCESSOR_MAPPING_NAMES.get(config.model_type)
    if name is None:
        raise ImportError(f"{path}: no processor class is known for model_type={config.model_type!r}")
    return by_name(name)
