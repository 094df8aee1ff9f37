#!/usr/bin/env bash
# Set up .venv: find a Python >= 3.12 on this machine, make the virtual environment with it and
# install runner (editable) with what training needs. The README's two commands and .ci/run
# start here. Safe to run again: an existing .venv of a new enough Python is reused, and extras
# named later are added to it.
#
#   bash tools/venv.sh                 training only: jax (CPU), flax, optax, orbax, grain, hydra, ...
#   bash tools/venv.sh test            + the test extra (transformers, torch CPU, lm-eval, ...) and
#                                      libtpu (the tests compile for TPU topologies: mode=compile)
#   bash tools/venv.sh cuda            + the GPU plugin of the pinned jax (CUDA 12 wheels; cuda13 for 13)
#   bash tools/venv.sh tpu             + libtpu: train on a TPU VM, or mode=compile for TPU topologies
#   bash tools/venv.sh sky             the SkyPilot client in .venv-sky (its pins clash with runner's); test adds it
#   bash tools/venv.sh docs            + mkdocs and mkdocs-material: build the docs site (mkdocs.yml); test has them
#   bash tools/venv.sh --system-jax    use the jax the chosen Python already has (an NVIDIA or TPU
#                                      container's): the venv sees its packages and pins that jax
#
# Installs go through uv (put into .venv by its pip the first time): it resolves the same versions
# as pip (the test set-up: the same 226 packages, checked with `pip freeze`) in a fraction of the
# time, downloading, unpacking and compiling bytecode in parallel. The bytecode is compiled ahead, as
# pip does, since under PYTHONDONTWRITEBYTECODE every process would compile what it imports. It is given
# pip's own settings (pip.conf and PIP_* variables: index-url, extra-index-url, find-links,
# constraint, no-index, trusted-host, cert), so a mirror pip would use is used. RUNNER_INSTALLER=pip
# installs with pip itself; so does --system-jax, and so does a machine where uv cannot be had.
#
# Other extras by name: lm_eval, optuna, slurm, ray, sky, bench, docs (pyproject.toml). Where it looks for Python,
# in order: $RUNNER_PYTHON, python3.12, python3.13, python3, python on PATH, then pyenv's versions
# (~/.pyenv/versions/3.1x.y). A pyenv shim for a version that is installed but not selected fails
# its version check and is skipped, so the version itself is found next.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
SKYPILOT_VERSION=0.14.1  # `sky`: the SkyPilot client, in .venv-sky
UV_VERSION=0.13.9  # the installer (below)

asked="$*"
extras=()
system_jax=0
sky=0
for arg in "$@"; do
    case "$arg" in
        test) extras+=(test tpu); sky=1 ;;
        sky) sky=1 ;;
        cuda|cuda13|tpu|lm_eval|optuna|slurm|ray|bench|docs) extras+=("$arg") ;;
        --system-jax) system_jax=1 ;;
        *)
            echo "error: tools/venv.sh does not know '$arg'. Fix: name extras from test, cuda, cuda13, tpu," \
                 "lm_eval, optuna, slurm, ray, sky, bench, docs, and/or --system-jax (e.g. 'bash tools/venv.sh test')." >&2
            exit 2 ;;
    esac
done

new_enough() {
    "$1" -c 'import sys, venv; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1
}

find_python() {
    local candidate
    for candidate in "${RUNNER_PYTHON:-}" python3.12 python3.13 python3 python; do
        if [ -n "$candidate" ] && command -v "$candidate" >/dev/null 2>&1 && new_enough "$candidate"; then
            command -v "$candidate"
            return 0
        fi
    done
    for candidate in $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[2-9]* 2>/dev/null | sort -V); do
        if new_enough "$candidate/bin/python3"; then
            echo "$candidate/bin/python3"
            return 0
        fi
    done
    return 1
}

sees_system() {
    grep -qi '^include-system-site-packages *= *true' .venv/pyvenv.cfg 2>/dev/null
}

# A Python that is itself a virtual environment (or conda env) with jax: the new venv's "system"
# would be that Python's base install, so its own site-packages are added through a .pth file.
see_env_of() {
    local dirs site
    dirs=$("$1" -c 'import site, sys; print("\n".join(site.getsitepackages()) if sys.prefix != sys.base_prefix else "")')
    if [ -n "$dirs" ]; then
        site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        echo "$dirs" > "$site/_runner_system_jax.pth"
    fi
}

if [ -x .venv/bin/python ] && ! new_enough .venv/bin/python; then
    echo "tools/venv.sh: .venv is $(.venv/bin/python -V 2>&1), older than runner needs (3.12+); making it anew." >&2
    rm -rf .venv
fi
if [ -x .venv/bin/python ] && [ "$system_jax" = 1 ] && ! sees_system; then
    echo "tools/venv.sh: .venv does not see the system's packages, which --system-jax needs; making it anew." >&2
    rm -rf .venv
fi
if [ ! -x .venv/bin/python ]; then
    if ! python=$(find_python); then
        echo "error: runner needs Python 3.12 or newer, and none was found (looked for python3.12, python3.13," \
             "python3 and python on PATH, and in ${PYENV_ROOT:-$HOME/.pyenv}/versions). Fix: install one" \
             "(e.g. 'pyenv install 3.12', 'uv python install 3.12' or 'apt-get install python3.12-venv')," \
             "or name it with RUNNER_PYTHON=/path/to/python3.12, then run this again." >&2
        exit 2
    fi
    if [ "$system_jax" = 1 ]; then
        if ! "$python" -c 'import jax' >/dev/null 2>&1; then
            echo "error: --system-jax uses the jax that $python already has, and it has none. Fix: name the" \
                 "container's Python with RUNNER_PYTHON=/path/to/python, or leave out --system-jax to install" \
                 "the pinned jax (add 'cuda' for NVIDIA GPUs)." >&2
            exit 2
        fi
        echo "tools/venv.sh: making .venv with $python ($("$python" -V 2>&1)), seeing its packages" >&2
        "$python" -m venv --system-site-packages .venv
        see_env_of "$python"
    else
        echo "tools/venv.sh: making .venv with $python ($("$python" -V 2>&1))" >&2
        "$python" -m venv .venv
    fi
fi

# pip's settings as uv's flags, one a line: pip takes the last of each key it reads (pip.conf files,
# then PIP_* variables) and merges every index it is given, as uv does with unsafe-best-match.
pip_settings_for_uv() {
    .venv/bin/python -m pip config list 2>/dev/null | .venv/bin/python -c '
import ast, sys
flags = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "--constraint", "trusted-host": "--allow-insecure-host"}
settings = {}
for line in sys.stdin:
    name, _, value = line.strip().partition("=")
    settings[name.partition(".")[2]] = ast.literal_eval(value) if value else ""
print("--index-strategy\nunsafe-best-match")
for key, flag in flags.items():
    for value in settings.get(key, "").split():
        print(f"{flag}\n{value}")
if settings.get("no-index", "").lower() in ("1", "true", "yes", "on"):
    print("--no-index")
if settings.get("cert"):
    print("cert=" + settings["cert"])
'
}

uv=()
if [ "${RUNNER_INSTALLER:-uv}" = uv ] && [ "$system_jax" = 0 ] && ! sees_system; then
    if [ -x .venv/bin/uv ] || .venv/bin/pip install -q "uv==$UV_VERSION" >/dev/null 2>&1 && [ -x .venv/bin/uv ]; then
        mapfile -t settings < <(pip_settings_for_uv)
        for setting in "${settings[@]}"; do
            case "$setting" in
                cert=*) export SSL_CERT_FILE="${setting#cert=}" ;;
                *) uv+=("$setting") ;;
            esac
        done
    else
        echo "tools/venv.sh: uv could not be installed from pip's index; installing with pip (slower)." >&2
    fi
fi

# pip install's arguments for the venv whose python is $1, through uv where it is there.
install_into() {
    local python="$1"
    shift
    if [ "${#uv[@]}" -gt 0 ]; then
        .venv/bin/uv pip install --python "$python" --compile-bytecode "${uv[@]}" "$@" || {
            echo "tools/venv.sh: uv could not install that (above). To install with pip instead:" \
                 "RUNNER_INSTALLER=pip bash tools/venv.sh $asked" >&2
            return 1
        }
    else
        "$(dirname "$python")/pip" install "$@"
    fi
}

spec="."
if [ "${#extras[@]}" -gt 0 ]; then
    spec=".[$(IFS=,; echo "${extras[*]}")]"
fi
if [ "$system_jax" = 1 ] || sees_system; then
    # The system's jax (and jaxlib, and its GPU or TPU plugin) stays: runner's other requirements
    # are installed against it, and a requirement that would replace it fails instead.
    jax_version=$(.venv/bin/python -c 'import jax; print(jax.__version__)')
    echo "tools/venv.sh: using the system's jax $jax_version (runner is tested with the version pyproject.toml pins)" >&2
    requirements=$(.venv/bin/python - "${extras[@]}" <<'EOF'
import re, sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
wanted = list(project["dependencies"])
for extra in sys.argv[1:]:
    wanted += project["optional-dependencies"][extra]
print("\n".join(r for r in wanted if re.split(r"[<>=!~\[; ]", r)[0].lower() not in ("jax", "jaxlib")))
EOF
)
    constraints=$(mktemp)
    trap 'rm -f "$constraints"' EXIT
    .venv/bin/python -c 'import jax, jaxlib; print(f"jax=={jax.__version__}\njaxlib=={jaxlib.__version__}")' > "$constraints"
    mapfile -t wanted <<< "$requirements"
    .venv/bin/pip install -q -c "$constraints" "${wanted[@]}"
    .venv/bin/pip install -q --no-deps -e .
elif [ "${#extras[@]}" -gt 0 ] || [ "$sky" = 0 ]; then
    install_into .venv/bin/python -q -e "$spec"
fi

if [ "$sky" = 1 ]; then
    # SkyPilot's client (tools/sky_task.py checks a task with it; `sky jobs launch` submits it) pins a
    # click older than wandb's, so it lives in a venv of its own: .venv-sky.
    if [ ! -x .venv-sky/bin/python ]; then
        "$(.venv/bin/python -c 'import sys; print(sys._base_executable)')" -m venv .venv-sky
    fi
    install_into .venv-sky/bin/python -q "skypilot==$SKYPILOT_VERSION"
fi
