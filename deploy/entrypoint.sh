#!/bin/sh
# Run specd with the arguments. The image has its models baked in (SPECD_FETCH=none); an
# image built with MODELS=none and an empty volume at $SPECD_CACHE sets SPECD_FETCH to a
# model set (default or small) to fetch it there once.
set -e
set_name="${SPECD_FETCH:-none}"
if [ "$set_name" != "none" ] && [ -z "$(ls -A "${SPECD_CACHE:-/models}/models" 2>/dev/null)" ]; then
  specd models fetch "$set_name"
fi
exec specd "$@"
