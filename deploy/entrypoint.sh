#!/bin/sh
# Fetch the model set into an empty cache volume once, then run specd with the arguments.
# SPECD_FETCH: the set to fetch ("default", "small", or "none" for a pre-filled volume).
set -e
set_name="${SPECD_FETCH:-default}"
if [ "$set_name" != "none" ] && [ -z "$(ls -A "${SPECD_CACHE:-/models}/models" 2>/dev/null)" ]; then
  specd models fetch "$set_name"
fi
exec specd "$@"
