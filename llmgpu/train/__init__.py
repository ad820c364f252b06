"""Chapter 7: the complete training loop.

* ``config.py``: ``TrainConfig``, the only home of training defaults; validation; the device choice.
* ``step.py``: ``TrainStep``, THE step (forward + backward, clip, AdamW, scaler; eager or one CUDA graph),
  used by the trainer, ``llmgpu bench`` and the chapters, with the seam data-parallel training fills in.
* ``trainer.py``: ``Trainer`` and ``train()``: the run loop, time budgets, checkpoints, samples.
* ``report.py``: the progress line and the JSON-lines log.
* ``data.py``: the embedded corpus, token shards, batches, the GPU prefetcher; ``tokenizers.py``: bytes, GPT-2 BPE.
* ``prepare.py``: ``llmgpu prepare``: text files -> token shards, in parallel over files, streaming.
* ``checkpoint.py``: atomic checkpoint directories (safetensors weights, optimizer state, metadata).
* ``pretrained.py``: weights from a Hugging Face GPT-2 directory or a run as a model (``llmgpu.from_pretrained``,
  ``train --init``), ``llmgpu export``; ``evaluate.py``: ``llmgpu eval`` (loss and perplexity on held-out data).
* ``rundir.py``: a run's output directory: no silent overwrite, where a resume writes, the log it continues.
* ``sampling.py``: prompts, sampling settings, a model loaded from sound weights only (``llmgpu sample``).
"""

from .config import ConfigError, TrainConfig, fast_path_available, resolve, select_xp
from .report import Progress, read_log
from .step import LocalGradSync, TrainStep, apply_update
from .trainer import Trainer, default_out_dir, prompt_ids, train

__all__ = ["ConfigError", "LocalGradSync", "Progress", "TrainConfig", "TrainStep", "Trainer", "apply_update",
           "default_out_dir", "fast_path_available", "prompt_ids", "read_log", "resolve", "select_xp", "train"]
