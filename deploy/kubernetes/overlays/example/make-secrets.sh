#!/bin/sh
# Writes the example overlay's Secret values under secrets/ (git ignores it), which the
# kustomization's secretGenerator reads; until they exist, the overlay does not render, so nothing
# deploys with a value copied from a repository. Each value is 32 random bytes in hex: nothing to
# escape in the Redis URL (base/gateway.yaml builds it) or an HTTP header. Files that exist are
# kept, so a second run changes nothing.
#
#   sh make-secrets.sh                       # the engines' key made here too
#   VLLM_API_KEY=... sh make-secrets.sh      # the key your engines already have (vLLM --api-key)
#
# Then add the printed admin key hash to policy.yaml (admin.key_hashes), and keep the files where
# your team keeps secrets (or replace the secretGenerator with your secret manager's objects, same
# names and keys).
set -eu
cd "$(dirname "$0")"
umask 077
mkdir -p secrets

random_hex() {
  od -An -N32 -tx1 /dev/urandom | tr -d ' \n'
}

# write FILE KEY VALUE: secrets/FILE holds KEY=VALUE, one line, unless it exists.
write() {
  if [ -e "secrets/$1" ]; then
    echo "secrets/$1: exists, kept"
  else
    printf '%s=%s\n' "$2" "$3" >"secrets/$1"
    echo "secrets/$1: written"
  fi
}

write redis.env password "$(random_hex)"
write cache-salt.env secret "$(random_hex)"
write backend-credentials.env VLLM_API_KEY "${VLLM_API_KEY:-$(random_hex)}"
write admin-key.env admin-key "$(random_hex)"

admin_key=$(sed -n 's/^admin-key=//p' secrets/admin-key.env)
echo "admin key hash for policy.yaml (admin.key_hashes): sha256:$(printf '%s' "$admin_key" | sha256sum | cut -d ' ' -f 1)"
echo "the engines must accept VLLM_API_KEY from secrets/backend-credentials.env (vLLM: --api-key)"
