"""Model weights on disk: the formats llmflow reads and writes, and the one way in and out.

The formats, side by side:

- Hugging Face: ``config.json``, ``model.safetensors`` (or shards listed by
  ``model.safetensors.index.json``) and the tokenizer files. ``hf.py`` (directories),
  ``hf_names.py`` (tensor names), ``safetensors_io.py`` (one file, a tensor at a time);
  quantized checkpoints (block-scaled FP8, MXFP4) read dequantized and FP8 written back,
  ``quantized.py``.
- Training checkpoint: ``CKPT/latest`` naming ``CKPT/step_NNNNNNNN/`` (DCP ``.metadata`` and
  ``*.distcp``, ``meta.json``, ``rng/``), and ``CKPT/tokenizer/``; a LoRA run keeps only its
  adapters and names its base. ``training_checkpoint.py`` (layout, meta, save, load),
  ``dcp.py`` (DCP directories), ``lora_adapters.py`` (adapters checked and merged); the
  tensors the decoder does not hold (a vision tower) kept untrained in ``CKPT/carried/``,
  ``carried.py``.
- Megatron-LM / MindSpeed-LLM: ``latest_checkpointed_iteration.txt`` naming ``iter_NNNNNNN/``
  (megatron-core's torch_dist, or the legacy ``mp_rank_*/model_optim_rng.pt``). ``megatron/``
  (layout, reader, importer, exporter).

The ways in and out:

- a model from whatever path a user gives (generation, evaluation, the start of training):
  ``load_model`` and ``hf_config_of`` (``loading.py``), ``tokenizer_dir``
  (``tokenizer_files.py``), ``is_checkpoint``;
- a training rank's own shards of a model built on the meta device and sharded there:
  ``sharded_source``, ``meta_model``, ``load_sharded`` (``sharded_loading.py``, imported from
  its module by the training loop alone);
- the training loop: ``save_checkpoint``, ``latest_step_dir``, ``load_checkpoint``,
  ``optimizer_state_flattened``, ``load_rng_state`` and ``carry_tokenizer`` (its run
  directory keeps the tokenizer of the model it started from), and ``carry_untrained``
  (``carried.py``, imported from its module: the tensors of that model the decoder does not
  hold);
- the stages that move weights between formats, ``llmflow convert`` (Hugging Face or
  Megatron -> training checkpoint, ``convert.py``) and ``llmflow export`` (training
  checkpoint -> Hugging Face, PEFT adapter or Megatron, ``export.py``, reading through
  ``tensor_source.py``). They are imported from their modules: they bring in
  torch.distributed.checkpoint, which loading a Hugging Face model never needs.

A state holding NaN or ±Inf is never saved, and ``load_model`` and convert refuse such
weights, naming the file and the tensor (``finite.py``).
"""

from llmflow.weights.errors import CheckpointError, NonFiniteError
from llmflow.weights.finite import first_nonfinite
from llmflow.weights.hf import load_hf_model, save_hf_model
from llmflow.weights.loading import hf_config_of, load_model
from llmflow.weights.tokenizer_files import carry_tokenizer, tokenizer_dir
from llmflow.weights.training_checkpoint import (
    CheckpointMeta,
    is_checkpoint,
    latest_step_dir,
    load_checkpoint,
    load_rng_state,
    optimizer_state_flattened,
    read_meta,
    resolve_step_dir,
    resume_note,
    save_checkpoint,
)

__all__ = [
    "CheckpointError",
    "CheckpointMeta",
    "NonFiniteError",
    "carry_tokenizer",
    "first_nonfinite",
    "hf_config_of",
    "is_checkpoint",
    "latest_step_dir",
    "load_checkpoint",
    "load_hf_model",
    "load_model",
    "load_rng_state",
    "optimizer_state_flattened",
    "read_meta",
    "resolve_step_dir",
    "resume_note",
    "save_checkpoint",
    "save_hf_model",
    "tokenizer_dir",
]
