#!/usr/bin/env bash
# `make test-quick`: the inner loop before a commit, in about a minute on a 2-core machine.
# The unit tests with a tenth of each property test's hypothesis examples (the `quick` profile
# of tests/_examples.py), and nbval on the notebooks changed since main (committed on this
# branch, staged, unstaged or new). `make test` stays the whole suite; CI runs that.
set -u
cd "$(dirname "$0")/.."
BIN=.venv/bin
WORKERS=${TEST_WORKERS:-$(nproc 2>/dev/null || echo 2)}
BASE=${BASE:-main}
status=0
t0=$SECONDS
FIXEDSTATE_TEST_PROFILE=quick $BIN/python -m pytest tests -q -m "not browser and not site and not kit and not grade_attack and not pdf" \
  -p no:cacheprovider -n "$WORKERS" --dist loadscope || status=1
changed=$( { git diff --name-only "$(git merge-base HEAD "$BASE" 2>/dev/null || echo HEAD)" -- ;
             git ls-files --others --exclude-standard; } |
           grep -E '^(chapters|exercises|solutions|appendix)/[^/]+\.ipynb$' | sort -u |
           while read -r f; do [ -f "$f" ] && echo "$f"; done )
if [ -n "$changed" ]; then
  echo "notebooks changed since $BASE:" $changed
  # shellcheck disable=SC2086
  FIXEDSTATE_TIMING=once $BIN/python -m pytest --nbval --nbval-current-env \
    --nbval-sanitize-with tests/nbval_sanitize.cfg --nbval-cell-timeout=600 -p no:cacheprovider -q \
    -n "$WORKERS" --dist loadfile $changed || status=1
else
  echo "no notebook changed since $BASE"
fi
echo "make test-quick: $([ $status = 0 ] && echo passed || echo FAILED) in $((SECONDS - t0)) s"
exit $status
