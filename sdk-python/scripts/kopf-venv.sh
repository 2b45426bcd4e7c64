#!/usr/bin/env bash
# Creates (once) the virtual environment with real kopf, pinned with every dependency, that the
# Python SDK's kopf-compatibility tests compare `capstan.kopf` against (its public namespace,
# its settings, its ids), and prints its python. The same venv runs kopf in the end-to-end
# differential test (tests/src/kopf.rs), which only needs `kopf==1.45.2` in it.
# Idempotent: an environment with these pins is reused; an existing one is brought to them.
# Location: $CAPSTAN_KOPF_VENV, or ~/.cache/capstan/kopf-venv.
set -euo pipefail

pins=(
	kopf==1.45.2
	aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 attrs==26.1.0 click==8.5.1
	frozenlist==1.8.0 idna==3.21 iso8601==2.1.0 jsonpatch==1.48 jsonpointer==3.12 multidict==7.2.1
	propcache==0.5.4 python-json-logger==4.2.0 PyYAML==6.0.4 typing_extensions==4.16.0 yarl==1.25.1
)
venv=${CAPSTAN_KOPF_VENV:-$HOME/.cache/capstan/kopf-venv}
python=${PYTHON:-python3}
stamp="$venv/.pins-$(printf '%s ' "${pins[@]}" | sha256sum | cut -c1-16)"

if [[ ! -f "$stamp" ]]; then
	if [[ ! -x "$venv/bin/python" ]]; then
		"$python" -m venv "$venv" >&2
	fi
	"$venv/bin/pip" install --quiet --disable-pip-version-check "${pins[@]}" >&2
	rm -f "$venv"/.pins-*
	touch "$stamp"
fi
echo "$venv/bin/python"
