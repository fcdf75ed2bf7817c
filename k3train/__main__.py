from k3train.cli import entry

entry()
