"""The `baton` command and the launchers: above every role, so it may import them all."""
