#!/usr/bin/env bash
# One stage of `make test`: runs the command, then prints the stage's seconds (and its exit code when it
# failed), so that every run of the suite says where its time went. Usage: tests/stage.sh NAME COMMAND...
name=$1
shift
start=$(date +%s)
"$@"
code=$?
seconds=$(( $(date +%s) - start ))
if [ "$code" -eq 0 ]; then
  echo "stage $name: $seconds s"
else
  echo "stage $name: $seconds s, failed (exit $code)"
fi
exit "$code"
