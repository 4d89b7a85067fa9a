"""Process roles: the rollout worker loop, engines, rewards, and the local launcher."""
