"""Process-level set-up shared by every command: distributed groups, CUDA environment, version and environment report, a clean process exit."""
