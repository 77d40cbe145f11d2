# Sourced by scripts/bootstrap and scripts/py-matrix: install_into PYTHON ARGS... installs
# packages into PYTHON's virtualenv. With uv (put into .venv by bootstrap; the same resolver
# result as pip, checked package by package) a fresh install of the dev extras takes about 10 s
# instead of about 70 s with pip; where uv cannot be had, pip does it.
install_into() {
    local python="$1"
    shift
    if [ -x .venv/bin/uv ]; then
        # --native-tls: the system's certificates, as pip uses (a proxy's own CA included).
        .venv/bin/uv pip install --quiet --native-tls --python "$python" "$@"
    else
        "$python" -m pip install --quiet "$@" 2>&1 | grep -v "^WARNING: Location" || true
    fi
}
