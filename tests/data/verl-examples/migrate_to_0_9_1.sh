#!/usr/bin/env bash
# The two changes between the stored scripts (verl commit 1dda039) and the installed verl 0.9.1
# that the scripts trip over, applied once to the copies here (see PROVENANCE.md). Each changed
# line keeps the original as a comment above it. Idempotent.
set -euo pipefail
cd "$(dirname "$0")"
# 1. verl 0.9.1 has no actor.megatron.grad_offload: param_offload now also releases the gradient
#    buffers (trainer/config/engine/megatron.yaml).
grep -rl 'actor_rollout_ref.actor.megatron.grad_offload=' examples | while read -r f; do
  sed -i -E 's|^([[:space:]]*)(actor_rollout_ref\.actor\.megatron\.grad_offload=.*)$|\1# verl 0.9.1 has no grad_offload (param_offload covers it): \2|' "$f"
done
# 2. verl 0.9.1 reads SAPO's tau_pos / tau_neg on the actor, not in policy_loss (actor/actor.yaml).
grep -rl '+actor_rollout_ref.actor.policy_loss.tau_' examples | while read -r f; do
  sed -i -E 's|^([[:space:]]*)\+actor_rollout_ref\.actor\.policy_loss\.(tau_(pos\|neg))=(.*)$|\1# verl 0.9.1: was +actor_rollout_ref.actor.policy_loss.\2=\4\n\1actor_rollout_ref.actor.\2=\4|' "$f"
done
