"""Models and files from elsewhere: Hugging Face GPT-2 directories in and out, the safetensors format.

* ``safetensors.py``: the safetensors file format, read and written with NumPy (the checkpoints' weights).
* ``hf.py``: ``config.json`` <-> ``GPTConfig``, Hugging Face tensor names and Conv1D layout <-> nanoGPT's,
  ``load_hf`` (a local directory as ``save_pretrained`` writes it) and ``export_hf`` (one it loads).

``llmgpu.from_pretrained(path)`` builds a model from such a directory (or an llmgpu run); ``llmgpu train
--init PATH`` fine-tunes one, ``llmgpu export`` writes one.
"""

from .hf import InteropError, config_from_hf, config_to_hf, export_hf, hf_to_nanogpt, is_hf_dir, load_hf, nanogpt_to_hf
from .safetensors import SafetensorsError, load_file, save_file

__all__ = ["InteropError", "SafetensorsError", "config_from_hf", "config_to_hf", "export_hf", "hf_to_nanogpt",
           "is_hf_dir", "load_file", "load_hf", "nanogpt_to_hf", "save_file"]
