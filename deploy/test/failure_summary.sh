#!/bin/bash
# deploy/test/failure_summary.sh: after a failed test run, a short account
# of what failed, written last so that the tail of a CI log shows it: the
# failed tests of the ordinary build (build/) and of the hardening run
# (build-hardening/), each with its assertion, sanitizer or timeout lines,
# and the fuzz targets that did not end clean. .ci/run calls it when the
# README's test command fails.
cd "$(dirname "$0")/../.."

# failed_tests DIR: the names of the tests ctest last saw fail in DIR.
failed_tests() {
  local list=$1/Testing/Temporary/LastTestsFailed.log
  [ -f "$list" ] && cut -d: -f2- "$list"
}

# The lines that say why a test failed: a compile error, a GoogleTest
# assertion, a sanitizer's report, a timeout, a failed CHECK.
why=': error: |Failure|FAILED|ERROR: |runtime error|SUMMARY: |Timeout|Check failed'
why+='|Expected|Which is|Value of'

# test_output DIR NAME: the lines of NAME's output in DIR's last ctest log
# that say why it failed.
test_output() {
  awk -v name="$2" '
    $0 ~ "^[0-9]+/[0-9]+ Test: " { inside = (substr($0, index($0, "Test: ") + 6) == name) }
    inside' "$1/Testing/Temporary/LastTest.log" |
    grep -E -A3 "$why" |
    head -40
}

for dir in build build-hardening; do
  [ -d "$dir/Testing/Temporary" ] || continue
  while IFS= read -r name; do
    [ -n "$name" ] || continue
    echo "=== $dir: $name failed"
    test_output "$dir" "$name"
  done < <(failed_tests "$dir")
done

for log in build-hardening/fuzz-*.log; do
  [ -f "$log" ] || continue
  stats=${log%.log}.stats
  [ -f "$stats" ] && continue
  echo "=== fuzz target $(basename "$log" .log | sed 's/^fuzz-//') did not end clean"
  grep -E -A12 'ERROR: |runtime error|SUMMARY: |Timeout|out-of-memory' "$log" | head -40
done
