#!/usr/bin/env bash
# The vLLM integration step: builds its own virtual environment with vLLM 0.33.0 on the CPU (no CUDA
# packages) and runs the tests marked `vllm` (tests/integrations). Called from .ci/run; runs alone too:
#     bash .ci/vllm_step.sh
# SPIN_VLLM_VENV: where the venv lives (default .venv-vllm in the repository, git-ignored). A venv whose
# stamp matches the pinned list below is reused; anything else is rebuilt from scratch.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${SPIN_VLLM_VENV:-.venv-vllm}"
PY="${PYTHON:-python3}"
start=$(date +%s)

# vllm==0.33.0 is installed with --no-deps: its full dependency set pulls ~1.8 GB of CUDA wheels (and
# torch==2.14.0). The import paths the plugin and its tests use need only the packages below, pinned to
# the versions this step was verified with, on the local CPU torch 2.13.0. (`pip check` complains about
# vLLM's torch==2.14.0 pin and its GPU-only requirements; harmless at the Python level.)
read -r -d '' PINNED <<'PINS' || true
aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated-doc==0.0.7 annotated-types==0.8.0
anyio==4.16.0 apache-tvm-ffi==0.1.15.post2 attrs==26.1.0 cachetools==8.0.2 cbor2==6.3.0
certifi==2026.10.19.post1 charset-normalizer==3.5.3 click==8.5.1 cloudpickle==3.1.3 einops==0.8.2
fastapi==0.136.3 filelock==4.3.1 frozenlist==1.8.0 fsspec==2026.9.0 h11==0.16.0 hf-xet==1.8.0
httpcore2==2.16.2 httpx2==2.16.2 huggingface_hub==2.4.0 idna==3.20 iniconfig==2.3.1 Jinja2==3.1.6
jiter==0.19.0 llguidance==1.7.6 markdown-it-py==4.3.0 MarkupSafe==3.0.4 mdurl==0.1.2 mpmath==1.3.0
msgspec==0.23.0 multidict==7.2.1 networkx==3.6.1 numpy==2.4.6 openai==3.57.0 openai-harmony==0.0.8
packaging==26.4 partial-json-parser==0.2.1.1.post7 pillow==13.0.0 pluggy==1.7.0 prometheus_client==0.26.0
propcache==0.5.4 psutil==7.2.2 py-cpuinfo==9.0.0 pybase64==1.5.1 pydantic==2.14.4 pydantic_core==2.50.5
Pygments==2.21.0 pytest==9.2.0 PyYAML==6.0.4 pyzmq==27.3.0 regex==2026.11.19 requests==2.34.2 rich==15.0.0
safetensors==0.8.0 shellingham==1.5.4 sniffio==1.3.1 starlette==1.10.0 sympy==1.14.0 tokenizers==0.23.3
tqdm==4.70.1 transformers==5.20.2 triton==3.9.0 truststore==0.10.5 typer==0.29.2 typing-inspection==0.4.5
typing_extensions==4.16.0 urllib3==2.8.0 uvloop==0.23.0 xgrammar==0.2.8 yarl==1.25.1
PINS
TORCH="torch==2.13.0"
VLLM="vllm==0.33.0"
STAMP="$(printf '%s\n' "$TORCH" "$VLLM" $PINNED | sha256sum | cut -c1-16)"

venv_ok() {
  [ -x "$VENV/bin/python" ] && [ "$(cat "$VENV/.spin-stamp" 2>/dev/null)" = "$STAMP" ] \
    && VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c "import vllm.model_executor.layers.sparse_attn_indexer" \
       >/dev/null 2>&1
}

if venv_ok; then
  echo "vllm-step: reusing $VENV"
else
  echo "vllm-step: building $VENV ($VLLM --no-deps, $TORCH CPU, pinned deps)"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q --retries 5)
  "${PIP[@]}" install "$TORCH" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
  "${PIP[@]}" install --no-deps "$VLLM" $PINNED 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
  echo "$STAMP" > "$VENV/.spin-stamp"
fi
# The project itself, without dependencies (torch and numpy are already there), always fresh.
"$VENV/bin/python" -m pip --disable-pip-version-check -q install --no-deps -e . >/dev/null
echo "vllm-step: environment ready in $(( $(date +%s) - start )) s"

rc=0
env -u SPIN_ENABLE -u SPIN_SPARSITY -u SPIN_EXPLORATION -u SPIN_POLICY -u SPIN_GAMMA -u SPIN_SEED -u SPIN_MTP -u SPIN_SHADOW \
  VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -m pytest -q -p no:cacheprovider -m vllm tests/integrations || rc=$?
echo "vllm-step: finished in $(( $(date +%s) - start )) s (pytest exit $rc)"
if [ "$rc" -eq 5 ]; then
  echo "vllm-step: pytest collected no vllm tests (exit 5): failing" >&2
  exit 1
fi
exit "$rc"
