"""`python -m cutp info` prints versions and backend availability for bug reports."""
import sys


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["info"]:
        from .info import main as info_main

        return info_main()
    if argv[:1] == ["bench"]:
        from .bench.__main__ import main as bench_main

        return bench_main(argv[1:])
    print("usage: python -m cutp info | python -m cutp bench ...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
