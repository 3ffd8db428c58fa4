"""What graphpar runs on: this process's logical devices (`devices`) and the group of processes it
trains with (`distributed`: rendezvous, stores, communicators). Imports `core` only."""
