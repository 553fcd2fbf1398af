"""`python tests/audit_serve.py LOG MARKER serve ...`: runs the vkengine CLI
under a Python audit hook (PEP 578) that appends to LOG every file event
(open, listing, removal, ...) whose arguments contain MARKER. The security
tests put MARKER in the model path (so startup is logged: the hook works) and
in every path a request carries (so any such open after startup shows up)."""
import sys

_EVENTS = {"open", "os.listdir", "os.scandir", "os.walk", "glob.glob", "os.remove", "os.rename", "os.mkdir",
           "os.rmdir", "os.symlink", "os.truncate", "os.chmod", "os.chown", "shutil.copyfile", "shutil.rmtree",
           "os.exec", "os.posix_spawn", "subprocess.Popen", "os.system"}


def main() -> int:
    log_path, marker = sys.argv[1], sys.argv[2]
    if marker in log_path:
        raise SystemExit("the log path must not hold the marker (the hook would log its own writes)")
    log = open(log_path, "a", buffering=1)

    def hook(event, args):
        if event in _EVENTS and marker in repr(args):
            log.write(f"{event} {args!r}\n")
    sys.addaudithook(hook)
    from vkengine.cli import main as cli
    return cli(sys.argv[3:])


if __name__ == "__main__":
    sys.exit(main())
