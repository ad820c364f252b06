"""Models and files from elsewhere: Hugging Face GPT-2 and Llama directories in and out, the safetensors format.

* ``safetensors.py``: the safetensors file format, read and written with NumPy (the checkpoints' weights).
* ``hf_files.py``: a Hugging Face directory's files: ``config.json``, one safetensors file or shards with an
  index, a PyTorch pickle, ``llmgpu.json``; atomic writes.
* ``hf_llama.py``: ``config.json`` <-> ``LlamaConfig`` and the checks of ``LlamaForCausalLM`` tensors (whose names
  and layouts are llmgpu's ``Llama``'s).
* ``hf.py``: ``config.json`` <-> ``GPTConfig``, Hugging Face tensor names and Conv1D layout <-> nanoGPT's, and
  ``load_hf`` (a local directory as ``save_pretrained`` writes it, GPT-2 or Llama) and ``export_hf`` (one it loads).

``llmgpu.from_pretrained(path)`` builds a model from such a directory (or an llmgpu run); ``llmgpu train
--init PATH`` fine-tunes one, ``llmgpu export`` writes one.
"""

from .hf import InteropError, config_from_hf, config_to_hf, export_hf, hf_to_nanogpt, is_hf_dir, load_hf, nanogpt_to_hf
from .hf_llama import hf_to_llama, llama_config_from_hf, llama_config_to_hf, llama_to_hf
from .safetensors import SafetensorsError, load_file, save_file

__all__ = ["InteropError", "SafetensorsError", "config_from_hf", "config_to_hf", "export_hf", "hf_to_llama",
           "hf_to_nanogpt", "is_hf_dir", "llama_config_from_hf", "llama_config_to_hf", "llama_to_hf", "load_file",
           "load_hf", "nanogpt_to_hf", "save_file"]
