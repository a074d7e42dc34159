#!/usr/bin/env bash
# Proves a wheel installs anywhere: installs it into a fresh virtual environment and runs
# the Python tests against it with the system's Highway (libhwy.so.1) made unavailable.
#
#   scripts/check_wheel.sh [--python PY] WHEEL
#       fresh venv + WHEEL, libhwy hidden: prints the ropepool imported (it must be the
#       wheel's), runs `python -m ropepool --version` and pytest tests/python; exit 0 = pass
#   scripts/check_wheel.sh --python PY --smoke WHEEL
#       for an interpreter without the test requirements (e.g. an abi3 wheel on 3.13):
#       NumPy from the package index instead, then the import, `python -m ropepool verify`
#       and one NumPy call, libhwy hidden as above
#   scripts/check_wheel.sh [--python PY] --expect-import-failure WHEEL
#       the negative control, for a wheel that was not repaired: `import ropepool` must fail
#       for want of libhwy (exit 0 when it does), which shows the check above can fail
#
# Highway is hidden without touching the system: the commands run in a private mount
# namespace (unshare -m; unprivileged users get a user namespace too) in which an empty
# file is bind-mounted over every libhwy.so.1* the dynamic loader knows; other processes
# on the machine still see the real library.
#
# The fresh venv has no system site-packages. The test requirements (torch, numpy, pytest,
# transformers, jax) are taken from an existing environment (CHECK_DEPS_PYTHON, default
# .venv/bin/python, as ./dev.sh creates it): a .pth file points at a folder of links to just
# those distributions and what they require, never to any ropepool there.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

py=python3
expect_failure=0
smoke=0
wheel=
while (($#)); do
  case "$1" in
    --python) py=${2:?}; shift 2 ;;
    --expect-import-failure) expect_failure=1; shift ;;
    --smoke) smoke=1; shift ;;
    -h|--help) sed -n '2,/^set -e/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "check_wheel.sh: unknown option '$1'" >&2; exit 2 ;;
    *) wheel=$(realpath "$1"); shift ;;
  esac
done
if [ ! -f "$wheel" ]; then
  echo "usage: scripts/check_wheel.sh [--python PY] [--smoke | --expect-import-failure] WHEEL" >&2
  exit 2
fi
deps_py=${CHECK_DEPS_PYTHON:-$ROOT/.venv/bin/python}

log() { printf '\n=== %s\n' "$*"; }
name=$(basename "$wheel" .whl)
work=$ROOT/build-wheel/check/$name
rm -rf "$work"
mkdir -p "$work"

log "fresh venv in $work/venv, installing $(basename "$wheel")"
"$py" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q --no-deps --no-index "$wheel"

if [ "$smoke" = 1 ]; then
  "$work/venv/bin/python" -m pip install -q numpy
else
# Links to the test requirements and everything they require, from the deps environment.
"$deps_py" - "$work/deps" <<'EOF'
import os
import re
import sys
from importlib import metadata

out = sys.argv[1]
os.makedirs(out)
todo, seen, linked = ["torch", "numpy", "pytest", "transformers", "jax"], set(), set()
while todo:
    name = re.split(r"[ ;<>=!~\[(]", todo.pop(), maxsplit=1)[0].lower().replace("_", "-")
    if name in seen:
        continue
    seen.add(name)
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        continue  # an optional or platform-specific requirement not installed there
    for req in dist.requires or []:
        if "extra ==" not in req:
            todo.append(req)
    for f in dist.files or []:
        top = f.parts[0]
        if top.endswith(".pth") or top == ".." or top.lower().startswith("ropepool"):
            continue
        src = os.path.join(str(dist.locate_file("")), top)
        if top not in linked and os.path.exists(src):
            os.symlink(src, os.path.join(out, top))
            linked.add(top)
print(f"linked {len(linked)} entries of {len(seen)} distributions")
EOF
site=$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$work/deps" >"$site/check_wheel_deps.pth"
fi

# The body runs inside the private mount namespace.
cat >"$work/inside.sh" <<'EOF'
set -euo pipefail
work=$1 expect_failure=$2 root=$3 smoke=$4
empty=$work/empty
: >"$empty"
for lib in $(ldconfig -p | awk '/libhwy\.so\.1/ {print $NF}' | sort -u); do
  real=$(readlink -f "$lib")
  mount --bind "$empty" "$real"
  echo "hidden: $lib -> $real"
done
py=$work/venv/bin/python
# The hiding works: the loader cannot open Highway any more.
if "$py" -c 'import ctypes; ctypes.CDLL("libhwy.so.1")' 2>/dev/null; then
  echo "libhwy.so.1 still loads: the check would prove nothing" >&2; exit 1
fi
echo "libhwy.so.1 does not load in this namespace"
cd "$work"  # not the repository root, so only the installed package can be imported
if [ "$expect_failure" = 1 ]; then
  if "$py" -c 'import ropepool' 2>"$work/import.err"; then
    echo "FAIL: import ropepool succeeded without libhwy" >&2; exit 1
  fi
  echo "import ropepool failed, as expected:"; tail -1 "$work/import.err"
  exit 0
fi
"$py" -c 'import ropepool; print("ropepool", ropepool.__version__, "from", ropepool.__file__)'
"$py" -c 'import ropepool, sys; sys.exit(not ropepool.__file__.startswith(sys.argv[1]))' "$work/venv/"
"$py" -m ropepool --version
if [ "$smoke" = 1 ]; then
  "$py" -m ropepool verify --threads 2
  "$py" - <<'PY'
import numpy as np
import ropepool
T, H, D, P = 3, 2, 64, 8
x = np.random.default_rng(0).standard_normal((3, T, H, D)).astype(np.float32)
k_pool, v_pool = np.zeros((P, H, D), np.float32), np.zeros((P, H, D), np.float32)
_, k_rot, _, _ = ropepool.rope_pool_fused(
    x[0], x[1], x[2], np.arange(T, dtype=np.int32), np.array([5, -1, 2], np.int32),
    k_pool, v_pool, head_dim=D, num_qo_heads=H, num_kv_heads=H, rope_base=10000.0)
assert (k_pool[5] == k_rot[0]).all() and (v_pool[2] == x[2][2]).all()
assert not k_pool[0].any()
print("NumPy call: pool rows written")
PY
  exit 0
fi
"$py" -m pytest -q -p no:cacheprovider --rootdir "$root" "$root/tests/python"
EOF

if [ "$(id -u)" = 0 ]; then ns=(unshare --mount --propagation private)
else ns=(unshare --map-root-user --mount --propagation private); fi
if ! "${ns[@]}" true 2>/dev/null; then
  echo "check_wheel.sh: cannot make a private mount namespace here (${ns[*]}): needs root" \
    "with CAP_SYS_ADMIN, or unprivileged user namespaces" >&2
  exit 2
fi
log "in a private mount namespace with libhwy.so.1 hidden"
"${ns[@]}" bash "$work/inside.sh" "$work" "$expect_failure" "$ROOT" "$smoke"
