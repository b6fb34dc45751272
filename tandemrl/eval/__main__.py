from tandemrl.eval.gsm8k import main

if __name__ == "__main__":
    main()
