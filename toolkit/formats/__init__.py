"""The checkpoint format library: the canonical stream and each on-disk format, registered in one table.

  ``canonical``   the stream between every reader and writer (``Source``, ``WriteRequest``)
  ``table``       ``Format(name, detect, reader, writer, describe)`` for every format, in detection order
  ``detect``      which format a path holds (``locate``) and its reader (``open_source``)
  ``describe``    what a checkpoint says of itself: the layout record, ``toolkit_megatron.json``
  ``hf``          HF safetensors (and pickled ``pytorch_model*.bin``) directories
  ``zero``        DeepSpeed ZeRO 1/2/3 (read) and its universal layout (read, write);
                  ``zero_index`` where each parameter lies, ``torchzip`` ``.pt`` archives without torch,
                  ``direct`` the torch-free ZeRO -> HF copy
  ``megatron``    megatron-core torch_dist (read, write); ``megatron_legacy`` Megatron-LM's per-rank files
  ``lora_zero``, ``lora_megatron``, ``peft``  LoRA adapters (detection; converted whole by ``toolkit/lora``)
  ``report``      what ``--verify`` found
  ``safeload``    allowlisted unpickling; ``pages`` memory-mapped reads that give their pages back;
  ``staging``     outputs built beside DST and renamed into place with a manifest
  ``errors``      ``ConvertError``, raised by all of them

Training (``toolkit/adapters``, ``toolkit/checkpoint``) reads and writes through this package; the
``convert`` command (``toolkit/convert``) is one user of it. Importing it imports no torch.
"""
