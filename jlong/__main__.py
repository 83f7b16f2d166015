from jlong.cli import run

run()
