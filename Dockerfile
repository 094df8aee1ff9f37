# The runner image. `docker run IMAGE job=gpt_small topology=v4-32` trains, as `python -m runner`
# does (docs/launching.md). Build with tools/build_image.py, or directly:
#
#   docker build -t runner .                                    # TPU (libtpu), python:3.12-slim
#   docker build -t runner:gpu --build-arg JAX_FLAVOUR=cuda .   # NVIDIA GPUs: the `cuda` extra, jax[cuda12]
#   docker build -t runner --secret id=ca,src=corp.pem .        # behind a TLS-intercepting proxy
#
# BASE_IMAGE: any Debian/Ubuntu-like image with Python >= 3.12 and its venv module.
# JAX_FLAVOUR: tpu (the package's `tpu` extra: libtpu), cpu (plain jax), cuda (the `cuda` extra: jax[cuda12]).
ARG BASE_IMAGE=python:3.12-slim

# ---- build: a virtual environment with runner installed (not editable) -------------------------
FROM ${BASE_IMAGE} AS build
ARG JAX_FLAVOUR=tpu
# A package index mirror, if PyPI is not reachable directly.
ARG PIP_INDEX_URL=https://pypi.org/simple
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# The dependencies first, in their own layer: a change to runner's code reuses it.
# The secret `ca` (a PEM bundle) is added to pip's trusted roots for these steps only: it is
# mounted, never copied, so it is in no layer of the image.
COPY pyproject.toml ./
RUN --mount=type=secret,id=ca \
    set -eu; \
    case "$JAX_FLAVOUR" in \
        tpu|cpu|cuda) ;; \
        *) echo "error: JAX_FLAVOUR=$JAX_FLAVOUR is not a flavour. Fix: --build-arg JAX_FLAVOUR=tpu, cpu or cuda." >&2; exit 2 ;; \
    esac; \
    python3 -m venv /opt/venv; \
    if [ -s /run/secrets/ca ]; then \
        cat "$(/opt/venv/bin/python -c 'import pip._vendor.certifi as c; print(c.where())')" \
            /run/secrets/ca > /tmp/ca-bundle.pem; \
        export PIP_CERT=/tmp/ca-bundle.pem; \
    fi; \
    /opt/venv/bin/python -c "import sys, tomllib; \
p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
extra = {'tpu': p['optional-dependencies']['tpu'], 'cpu': [], 'cuda': p['optional-dependencies']['cuda']}; \
print('\n'.join(p['dependencies'] + extra[sys.argv[1]]))" "$JAX_FLAVOUR" > /tmp/requirements.txt; \
    /opt/venv/bin/pip install -r /tmp/requirements.txt; \
    rm -f /tmp/ca-bundle.pem /tmp/requirements.txt
COPY README.md setup.py _runner_lm_eval.py runner-lm-eval.pth ./
COPY runner/ runner/
COPY jobs/ jobs/
RUN --mount=type=secret,id=ca \
    set -eu; \
    if [ -s /run/secrets/ca ]; then \
        cat "$(/opt/venv/bin/python -c 'import pip._vendor.certifi as c; print(c.where())')" \
            /run/secrets/ca > /tmp/ca-bundle.pem; \
        export PIP_CERT=/tmp/ca-bundle.pem; \
    fi; \
    /opt/venv/bin/pip install --no-deps /src; \
    /opt/venv/bin/pip check; \
    /opt/venv/bin/pip uninstall -y -q setuptools; \
    rm -f /tmp/ca-bundle.pem

# ---- final: the base image, the environment, conf/ and jobs/; no compilers, no pip caches ------
FROM ${BASE_IMAGE}
ARG JAX_FLAVOUR=tpu
COPY --from=build /opt/venv /opt/venv
# An unprivileged user (uid 10001) owns only what the run writes: runs/, the cache and its home.
# They are also writable by any uid (mode 1777, like /tmp), so `docker run --user UID:GID` works:
# tools/launch_tpu.py runs as the TPU VM's login user.
RUN set -eu; \
    if command -v useradd >/dev/null 2>&1; then \
        useradd --uid 10001 --user-group --create-home --home-dir /home/runner --shell /bin/sh runner; \
    else \
        echo 'runner:x:10001:10001::/home/runner:/bin/sh' >> /etc/passwd; \
        echo 'runner:x:10001:' >> /etc/group; \
        mkdir -p /home/runner; \
    fi; \
    mkdir -p /opt/runner/runs /opt/runner/cache; \
    chown -R 10001:10001 /home/runner /opt/runner/runs /opt/runner/cache; \
    chmod 1777 /home/runner /opt/runner/runs /opt/runner/cache
COPY conf/ /opt/runner/conf/
COPY jobs/ /opt/runner/jobs/
# jobs/ in the working directory comes first on sys.path: mount your own over it to add jobs.
ENV PATH=/opt/venv/bin:$PATH \
    RUNNER_CONF_DIR=/opt/runner/conf \
    RUNNER_CACHE=/opt/runner/cache \
    HOME=/home/runner \
    PYTHONUNBUFFERED=1 \
    RUNNER_JAX_FLAVOUR=${JAX_FLAVOUR}
WORKDIR /opt/runner
USER 10001:10001
ENTRYPOINT ["python", "-m", "runner"]
