# Aliases for the scripts the README documents.
.PHONY: setup demo test
setup:
	scripts/setup
demo:
	scripts/demo
test:
	scripts/test
