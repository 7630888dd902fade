#!/usr/bin/env bash
# Build benchmarks/.trl-venv: a separate environment with TRL for benchmarks/bench_trl_reasoning.py.
# TRL is not a dependency of vlrl; this venv never installs vlrl (the benchmark loads the few
# standalone files it needs by path).
#
#   bash benchmarks/trl_env.sh            # (re)create the venv
#   PYTHON=python3.11 bash benchmarks/trl_env.sh
#
# torch + torchvision: Qwen2.5-VL's processor needs torchvision (its video processor), and a
# torchvision wheel only loads with the torch build it was made for. CPU builds of both are used
# when the local wheel directories ($PIP_FIND_LINKS) or the PyTorch CPU index have them; otherwise
# the plain PyPI wheels (CUDA builds, larger; they run on CPU as well).
# The venv is recreated from scratch each time, so a rerun never mixes builds.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
venv="$here/.trl-venv"
uv="$(command -v uv || echo "$root/.venv/bin/uv")"
python="${PYTHON:-$(test -x "$root/.venv/bin/python" && "$root/.venv/bin/python" -c 'import sys; print(sys._base_executable)' || echo python3)}"

# same torch and transformers lines as vlrl's .venv (pyproject: transformers>=5.16,<5.20)
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
TORCHVISION_VERSION="${TORCHVISION_VERSION:-0.28.0}"
TRANSFORMERS_SPEC="${TRANSFORMERS_SPEC:-transformers==5.19.0}"
TRL_SPEC="${TRL_SPEC:-trl==1.16.0}"

"$uv" venv --clear --python "$python" "$venv"
pip_install() { "$uv" pip install --python "$venv/bin/python" "$@"; }

find_links=()
for dir in ${PIP_FIND_LINKS:-}; do find_links+=(--find-links "$dir"); done
have_local_cpu=1
for pkg in "torch-$TORCH_VERSION" "torchvision-$TORCHVISION_VERSION"; do
  found=0
  for dir in ${PIP_FIND_LINKS:-}; do
    if compgen -G "$dir/$pkg+cpu-*.whl" >/dev/null; then found=1; fi
  done
  [[ $found == 1 ]] || have_local_cpu=0
done
cpu_index=https://download.pytorch.org/whl/cpu
if [[ $have_local_cpu == 1 ]]; then
  pip_install "${find_links[@]}" "torch==$TORCH_VERSION+cpu" "torchvision==$TORCHVISION_VERSION+cpu"
elif curl -sfI -m 10 "$cpu_index/" >/dev/null 2>&1; then
  pip_install --index-url "$cpu_index" "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION"
else
  echo "no CPU build of torch + torchvision reachable: installing the PyPI wheels" >&2
  pip_install "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION"
fi

# pin torch/torchvision to what is installed so the resolver keeps that build
pins="$("$venv/bin/python" -c 'from importlib.metadata import version as v
print(" ".join(n + "==" + v(n) for n in ("torch", "torchvision")))')"
# shellcheck disable=SC2086
pip_install $pins "$TRL_SPEC" "$TRANSFORMERS_SPEC" pillow math-verify jinja2

"$venv/bin/python" - <<'EOF'
import importlib.metadata as md

for name in ("trl", "transformers", "torch", "torchvision", "accelerate", "datasets", "pillow", "math-verify"):
    print(f"{name}=={md.version(name)}")
EOF
